"""llama.cpp's side of `python -m quantkit.bench.vs_llamacpp`, run by the llama-cpp-python venv's python.

Standalone (imports only llama_cpp, numpy and the standard library). Four modes:

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
  python llamacpp_worker.py batched '{"model": "path.gguf", "threads": n, "n_ctx": n, "max_seqs": n}'
      N sequences decoded together through llama.cpp's own batch API (one llama_batch holding one token of each
      sequence, under its own sequence id, per step), as llama-server's parallel slots do: loads the model once
      (a context of max_seqs sequences of n_ctx tokens each), prints {"ready": true, ...}, then for each JSON line
      {"prompts": [[ids]] (at most max_seqs), "max_tokens": n} clears the KV cache, evaluates each prompt under its
      sequence id (the prefill), then decodes all sequences greedily in lockstep (argmax; no EOS check) and answers
      {"prefill_s", "decode_s", "decode_tok_s", "tokens": [[ids] per prompt]}: decode_s covers the max_tokens - 1
      steps after the prefill's tokens, decode_tok_s = sequences x (max_tokens - 1) / decode_s. "quit" ends it.
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
    from llama_cpp import Llama

    models = {name: Llama(model_path=path, n_ctx=args["n_ctx"], n_batch=args["n_ctx"], n_threads=args["threads"],
                          n_threads_batch=args["threads"], seed=0, verbose=False)
              for name, path in args["models"].items()}
    answer_jobs(lambda job: greedy(models[job["model"]], job["prompt"], job["max_tokens"], job.get("logits", False)))


def answer_jobs(handle) -> None:
    """Say ready (with llama.cpp's version and system info), then answer each JSON line on stdin with
    handle(job) as one JSON line, until a line "quit"."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    print(json.dumps({"ready": True, "system_info": info, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        print(json.dumps(handle(json.loads(line))), flush=True)


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


class BatchedDecoder:
    """A llama.cpp context of `max_seqs` sequences, fed through llama_batch (llama-cpp-python's low-level API)."""

    def __init__(self, model: str, threads: int, n_ctx: int, max_seqs: int):
        import llama_cpp

        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(model.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {model}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_ctx * max_seqs, max_seqs
        params.n_batch = params.n_ubatch = max(n_ctx, max_seqs)
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not make a context of {max_seqs} x {n_ctx} tokens")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self.max_seqs = max_seqs

    def _decode(self, entries: list) -> None:
        """One llama_decode of `entries` [(token, position, sequence id, wants logits)]."""
        import llama_cpp

        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise SystemExit(f"llama_decode failed: {rc}")

    def _argmax(self, i: int) -> int:
        import llama_cpp
        import numpy as np

        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))))

    def run(self, prompts: list, max_tokens: int) -> dict:
        import llama_cpp

        if not 0 < len(prompts) <= self.max_seqs:
            raise SystemExit(f"{len(prompts)} prompts for a context of {self.max_seqs} sequences")
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        tokens = []
        for seq, prompt in enumerate(prompts):  # each prompt alone: logits of its last token only
            self._decode([(t, pos, seq, pos == len(prompt) - 1) for pos, t in enumerate(prompt)])
            tokens.append([self._argmax(len(prompt) - 1)])
        t1 = time.perf_counter()
        for step in range(max_tokens - 1):
            self._decode([(out[-1], len(p) + step, seq, True) for seq, (p, out) in enumerate(zip(prompts, tokens))])
            for i, out in enumerate(tokens):
                out.append(self._argmax(i))
        t2 = time.perf_counter()
        decode_s = t2 - t1
        rate = len(prompts) * (max_tokens - 1) / decode_s if decode_s > 0 else 0.0
        return {"prefill_s": t1 - t0, "decode_s": decode_s, "decode_tok_s": rate, "tokens": tokens}


def batched(args: dict) -> None:
    decoder = BatchedDecoder(args["model"], args["threads"], args["n_ctx"], args["max_seqs"])
    answer_jobs(lambda job: decoder.run(job["prompts"], job["max_tokens"]))


MODES = {"speculate": lambda: speculate(json.loads(sys.argv[2])), "batched": lambda: batched(json.loads(sys.argv[2])),
         "serve": lambda: serve(json.loads(sys.argv[2])),
         "quantize": lambda: quantize(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))}


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in MODES:
        raise SystemExit(f"usage: llamacpp_worker.py {{{'|'.join(MODES)}}} ARGS (see the module's docstring)")
    MODES[sys.argv[1]]()


if __name__ == "__main__":
    main()
