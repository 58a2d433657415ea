"""vLLM's side of `quantkit bench engine --against-vllm VENV`, run by that venv's python (started and fed by
quantkit/bench/vllm_process.py).

Standalone (imports only vLLM and the standard library): loads the model once, then for each JSON
line on stdin {"prompts": [[ids]], "max_tokens": n} runs greedy generation with ignore_eos and
answers one JSON line {"seconds": s, "tokens": n}. A line "quit" ends it.
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
              enable_prefix_caching=True, seed=0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        job = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        print(json.dumps({"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}), flush=True)


if __name__ == "__main__":
    main()
