"""vLLM's side of `quantkit bench engine --against-vllm VENV`, run by that venv's python (started and fed by
quantkit/bench/vllm_process.py).

Standalone (imports only vLLM and the standard library): loads the model once (with vLLM's speculative_config where
the arguments give one), then for each JSON line on stdin {"prompts": [[ids]], "max_tokens": n} (and optionally
"temperature": t, sampled with seed 0 when t > 0) runs generation with ignore_eos and answers one JSON line
{"seconds": s, "tokens": n, "token_ids": [[ids]]}. A line "quit" ends it.
"""

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = json.loads(sys.argv[1])
    llm = LLM(args["model"], dtype=args["dtype"], enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=args["max_model_len"], max_num_seqs=args["max_num_seqs"],
              enable_prefix_caching=True, seed=0, speculative_config=args.get("speculative_config"))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        job = json.loads(line)
        temperature = job.get("temperature", 0.0)
        params = SamplingParams(temperature=temperature, seed=0 if temperature > 0 else None,
                                max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        ids = [list(o.outputs[0].token_ids) for o in outs]
        print(json.dumps({"seconds": seconds, "tokens": sum(len(i) for i in ids), "token_ids": ids}), flush=True)


if __name__ == "__main__":
    main()
