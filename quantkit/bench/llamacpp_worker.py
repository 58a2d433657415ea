"""llama.cpp's side of `python -m quantkit.bench.vs_llamacpp`, run by the llama-cpp-python venv's python.

Standalone (imports only llama_cpp, numpy and the standard library). Two modes:

  python llamacpp_worker.py quantize IN.gguf OUT.gguf TYPE THREADS
      llama_model_quantize to TYPE (Q4_0, Q4_K_M, ...); prints one JSON line {"seconds": s}.
  python llamacpp_worker.py serve '{"models": {"name": "path.gguf"}, "threads": n, "n_ctx": n}'
      loads every model once, prints {"ready": true, "system_info": ...}, then for each JSON line
      {"model": name, "prompt": [ids], "max_tokens": n} decodes greedily at batch 1 (argmax of the
      logits; no EOS check) and answers {"prefill_s", "decode_s", "tokens", "first_logits"}:
      prefill_s: the prompt's evaluation and the first token; decode_s: the remaining max_tokens - 1
      tokens, one evaluation each. first_logits are the logits after the prompt (only when the job
      asks "logits": true). A line "quit" ends it.
  python llamacpp_worker.py speculate '{"model": "path.gguf", "threads": n, "n_ctx": n, "k": K, "ngram": N,
                                        "max_tokens": n, "rounds": r, "workloads": {"name": {"prompts": [[ids]],
                                        "temperature": t}}}'
      llama-cpp-python's own n-gram speculation (LlamaPromptLookupDecoding, N-gram lookup, K drafts) against the
      same model without it, in alternating rounds; prints one JSON line {name: {"plain": [tok/s a round],
      "spec": [...], "same": greedy tokens identical}}. Generation ignores EOS (Llama.generate does not stop).
"""

import ctypes
import json
import sys
import time


def quantize(src: str, dst: str, kind: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = threads
    t = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {kind} failed: {rc}")
    print(json.dumps({"seconds": time.perf_counter() - t}), flush=True)


def last_logits(llm):
    """The logits of the last evaluated token, read from llama.cpp's buffer ([vocab] float32, a view)."""
    import llama_cpp
    import numpy as np

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def greedy(llm, prompt: list, max_tokens: int, want_logits: bool) -> dict:
    import numpy as np

    llm.reset()  # n_tokens = 0; eval drops the KV cache past n_tokens before it decodes
    t0 = time.perf_counter()
    llm.eval(prompt)  # without logits_all, llama.cpp computes the logits of the last token only
    logits = last_logits(llm)
    tokens = [int(np.argmax(logits))]
    t1 = time.perf_counter()
    first = [float(x) for x in logits] if want_logits else None
    while len(tokens) < max_tokens:
        llm.eval(tokens[-1:])
        tokens.append(int(np.argmax(last_logits(llm))))
    t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": tokens, "first_logits": first}


def serve(args: dict) -> None:
    import llama_cpp
    from llama_cpp import Llama

    models = {name: Llama(model_path=path, n_ctx=args["n_ctx"], n_batch=args["n_ctx"], n_threads=args["threads"],
                          n_threads_batch=args["threads"], seed=0, verbose=False)
              for name, path in args["models"].items()}
    info = llama_cpp.llama_print_system_info().decode()
    print(json.dumps({"ready": True, "system_info": info, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        job = json.loads(line)
        print(json.dumps(greedy(models[job["model"]], job["prompt"], job["max_tokens"], job.get("logits", False))),
              flush=True)


def decode(llm, prompt: list, max_tokens: int, temperature: float) -> list:
    """max_tokens tokens after `prompt` (greedy at temperature 0, else plain sampling at it, seeded)."""
    llm.set_seed(0)
    out = []
    sampling = dict(top_k=1) if temperature == 0 else dict(top_k=0, top_p=1.0, min_p=0.0, temp=temperature)
    for token in llm.generate(prompt, reset=True, repeat_penalty=1.0, **sampling):
        out.append(int(token))
        if len(out) == max_tokens:
            break
    return out


def speculate(args: dict) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = dict(model_path=args["model"], n_ctx=args["n_ctx"], n_batch=args["n_ctx"], n_threads=args["threads"],
                  n_threads_batch=args["threads"], seed=0, verbose=False)
    plain = Llama(**common)
    spec = Llama(**common, draft_model=LlamaPromptLookupDecoding(max_ngram_size=args["ngram"],
                                                                  num_pred_tokens=args["k"]))
    report = {}
    for name, load in args["workloads"].items():
        prompts, temperature, n = load["prompts"], load["temperature"], args["max_tokens"]
        same = all(decode(plain, p, n, 0.0) == decode(spec, p, n, 0.0) for p in prompts)
        rates = {"plain": [], "spec": []}
        for llm in (plain, spec):  # warm-up
            decode(llm, prompts[0], n, temperature)
        for r in range(args["rounds"]):
            order = (("plain", plain), ("spec", spec)) if r % 2 == 0 else (("spec", spec), ("plain", plain))
            for label, llm in order:
                start = time.perf_counter()
                tokens = sum(len(decode(llm, p, n, temperature)) for p in prompts)
                rates[label].append(tokens / (time.perf_counter() - start))
        report[name] = {**rates, "same": same}
    print(json.dumps(report), flush=True)


def main() -> None:
    if sys.argv[1] == "quantize":
        quantize(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif sys.argv[1] == "speculate":
        speculate(json.loads(sys.argv[2]))
    else:
        serve(json.loads(sys.argv[2]))


if __name__ == "__main__":
    main()
