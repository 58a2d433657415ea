"""AsyncLLM on stories260K: streaming equals the offline engine (a slow consumer gets the newest
output), cancellation aborts and frees every block, the queue bound, failures that fail their
requests or kill the engine (never a hang), and shutdown's drain. Plain tests around `asyncio.run`;
every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from quantkit.engine import LLM, EngineConfig, SamplingParams
from quantkit.engine.async_llm import AsyncLLM, EngineDeadError, EngineNotReadyError, QueueFullError
from quantkit.errors import QuantkitError
from quantkit.engine.stats import StepStats

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
ENDLESS = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
IN_FLIGHT = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # still running when polled


def config(stories_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(stories_dir), **{"max_num_seqs": 8, "max_model_len": 512, "dtype": "float32", **kw})


async def collect(llm: AsyncLLM, prompt, params, rid: str) -> list:
    return [out async for out in llm.generate(prompt, params, rid)]


async def wait_until(cond, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def all_blocks_free(llm: AsyncLLM) -> bool:
    st = llm.get_stats()
    return st.num_running == st.num_waiting == 0 and st.kv_blocks_free == st.kv_blocks_total


def test_streams_equal_the_offline_engine_and_end_finished(stories_dir):
    offline = LLM(str(stories_dir), max_model_len=512, dtype="float32")
    expected = [o.outputs[0] for o in offline.generate(PROMPTS, GREEDY)]

    async def main():
        llm = AsyncLLM(config(stories_dir))
        assert llm.state == "loading"
        await llm.start()
        assert llm.state == "ready" and llm.engine.max_model_len == 512
        streams = await asyncio.gather(*(collect(llm, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)))
        await llm.shutdown(5)
        return streams

    for stream, want in zip(asyncio.run(main()), expected):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        last = stream[-1].outputs[0]
        assert (last.token_ids, last.text, last.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(set(lengths)) and lengths[0] >= 1  # cumulative, growing


def test_a_slow_consumer_gets_the_newest_output_not_a_backlog(stories_dir):
    async def main():
        llm = AsyncLLM(config(stories_dir))
        await llm.start()
        seen = []
        async for out in llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "s"):
            seen.append(out)
            await asyncio.sleep(0.2)  # much slower than a stories260K step
        await llm.shutdown(5)
        return seen

    seen = asyncio.run(main())
    assert seen[-1].finished and len(seen[-1].outputs[0].token_ids) == 40
    assert len(seen) < 40  # intermediate outputs coalesced; each one cumulative
    assert all(b.outputs[0].token_ids[:len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
               for a, b in zip(seen, seen[1:]))


def test_cancelled_and_abandoned_consumers_abort_their_requests(stories_dir):
    async def main():
        llm = AsyncLLM(config(stories_dir))
        await llm.start()

        started = asyncio.Event()

        async def consume(rid):
            async for _ in llm.generate(PROMPTS[0], ENDLESS, rid):
                started.set()

        task = asyncio.create_task(consume("cancelled"))
        await asyncio.wait_for(started.wait(), 20)  # cancelled at its first output, long before its 400th token
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await wait_until(lambda: all_blocks_free(llm))
        async with contextlib.aclosing(llm.generate(PROMPTS[1], ENDLESS, "broke")) as gen:
            async for out in gen:
                if len(out.outputs[0].token_ids) >= 3:  # (outputs coalesce: a slow consumer may never see 3)
                    break
        # the abort is a message to the engine loop: wait for its effect in the stats snapshot, not only the blocks
        await wait_until(lambda: all_blocks_free(llm) and llm.get_stats().finished_by_reason.get("abort") == 2)
        await llm.abort("nobody")  # unknown ids are ignored
        st = llm.get_stats()
        await llm.shutdown(5)
        return st

    st = asyncio.run(main())
    assert st.finished_by_reason["abort"] == 2 and st.kv_blocks_free == st.kv_blocks_total


def test_queue_bound_raises_queue_full_and_bad_prompts_raise(stories_dir):
    async def main():
        llm = AsyncLLM(config(stories_dir, max_num_seqs=1), max_queued_requests=1)
        await llm.start()
        running = asyncio.create_task(collect(llm, PROMPTS[0], ENDLESS, "a"))
        await wait_until(lambda: llm.num_running() == 1)
        queued = asyncio.create_task(collect(llm, PROMPTS[1], GREEDY, "b"))
        await wait_until(lambda: llm.num_waiting() == 1)
        with pytest.raises(QueueFullError, match="1 requests are already queued"):
            await collect(llm, PROMPTS[2], GREEDY, "c")
        await llm.abort("a")
        outs_a, outs_b = await asyncio.wait_for(asyncio.gather(running, queued), 30)
        with pytest.raises(QuantkitError, match="more than max_model_len 512"):
            await collect(llm, list(range(3, 603)), GREEDY, "long")
        with pytest.raises(QuantkitError, match="empty prompt"):
            await collect(llm, "", GREEDY, "empty")
        await llm.shutdown(5)
        return outs_a[-1], outs_b[-1]

    a, b = asyncio.run(main())
    assert a.outputs[0].finish_reason == "abort" and b.outputs[0].finish_reason == "length"


def test_a_failed_step_fails_its_requests_and_the_engine_recovers(stories_dir):
    async def main():
        llm = AsyncLLM(config(stories_dir))
        await llm.start()
        runner = llm.engine.runner
        real = runner.execute
        calls = {"n": 0}

        def flaky(out):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("simulated device fault")
            return real(out)

        runner.execute = flaky
        failed = await asyncio.wait_for(collect(llm, PROMPTS[0], GREEDY, "x"), 30)
        ok = await asyncio.wait_for(collect(llm, PROMPTS[1], GREEDY, "y"), 30)
        state = llm.state
        await wait_until(lambda: all_blocks_free(llm))
        await llm.shutdown(5)
        return failed[-1], ok[-1], state

    failed, ok, state = asyncio.run(main())
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "simulated device fault" in failed.error
    assert ok.outputs[0].finish_reason == "length" and state == "ready"


def test_failing_steps_in_a_row_mark_the_engine_dead(stories_dir):
    from quantkit.engine.async_llm import MAX_CONSECUTIVE_FAILURES

    async def main():
        llm = AsyncLLM(config(stories_dir))
        await llm.start()

        def broken(out):
            raise RuntimeError("device lost")

        llm.engine.runner.execute = broken
        lasts = []
        for i in range(MAX_CONSECUTIVE_FAILURES):  # one request per step, each failed by its step
            lasts.append((await asyncio.wait_for(collect(llm, PROMPTS[i], GREEDY, f"f{i}"), 30))[-1])
        await wait_until(lambda: llm.state == "dead")
        with pytest.raises(EngineDeadError, match="3 engine steps failed in a row"):
            await collect(llm, PROMPTS[0], GREEDY, "after")
        await llm.shutdown(1)
        return lasts

    lasts = asyncio.run(main())
    assert all(o.finished and o.outputs[0].finish_reason == "error" and "device lost" in o.error for o in lasts)


def test_a_dead_engine_ends_every_stream_with_an_error(stories_dir):
    async def main():
        llm = AsyncLLM(config(stories_dir))
        await llm.start()
        streams = [asyncio.create_task(collect(llm, p, ENDLESS, f"r{i}")) for i, p in enumerate(PROMPTS)]
        await wait_until(lambda: llm.num_running() == len(PROMPTS))

        def broken():
            raise ValueError("bookkeeping bug")

        llm.engine.scheduler.schedule = broken
        results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 30)
        with pytest.raises(EngineDeadError, match="bookkeeping bug"):
            await collect(llm, PROMPTS[0], GREEDY, "late")
        state, error = llm.state, llm.error
        await llm.shutdown(1)
        return results, state, error

    results, state, error = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert state == "dead" and "ValueError: bookkeeping bug" in error


def test_shutdown_drains_then_aborts_the_rest(stories_dir):
    async def main():
        llm = AsyncLLM(config(stories_dir))
        await llm.start()
        short = asyncio.create_task(collect(llm, PROMPTS[0], IN_FLIGHT, "short"))
        await wait_until(lambda: llm.num_running() == 1)
        await llm.shutdown(30)  # drains: the short request completes
        drained = await short

        llm2 = AsyncLLM(config(stories_dir))
        await llm2.start()
        endless = asyncio.create_task(collect(llm2, PROMPTS[1], ENDLESS, "endless"))
        await wait_until(lambda: llm2.num_running() == 1)
        stopping = asyncio.create_task(llm2.shutdown(0.2))
        await wait_until(lambda: llm2.state != "ready")
        with pytest.raises(EngineNotReadyError, match="draining"):
            await collect(llm2, PROMPTS[0], GREEDY, "new")
        await asyncio.wait_for(stopping, 30)
        return drained[-1], (await endless)[-1], llm2.state

    drained, aborted, state = asyncio.run(main())
    assert drained.outputs[0].finish_reason == "length" and len(drained.outputs[0].token_ids) == 200
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort" and state == "stopped"


@pytest.mark.slow
def test_many_streams_with_random_disconnects_leak_nothing(stories_dir):
    """40 concurrent streams (n=1 and n=2, under a small pool with swap), a quarter of them leaving at a
    random point: every other stream ends finished, every sample is counted once, and every KV and
    swap block comes back."""
    import random

    rng = random.Random(0)

    async def main():
        llm = AsyncLLM(config(stories_dir, max_num_seqs=16, max_model_len=128, num_kv_blocks=24,
                              swap_space=0.001))
        await llm.start()

        async def client(i):
            params = SamplingParams(temperature=0.7, seed=i, max_tokens=rng.randint(4, 40), n=1 + i % 2,
                                    ignore_eos=True)
            cut = rng.randint(1, 20) if i % 4 == 0 else None
            async with contextlib.aclosing(llm.generate(PROMPTS[i % 4] * (1 + i % 3), params, f"c{i}")) as gen:
                seen = 0
                async for out in gen:
                    seen += 1
                    if seen == cut and not out.finished:
                        return None  # the client leaves mid-stream
            return out

        results = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(40))), 120)
        await wait_until(lambda: all_blocks_free(llm))
        st = llm.get_stats()
        await llm.shutdown(5)
        return results, st

    results, st = asyncio.run(main())
    done = [r for r in results if r is not None]
    assert all(r.finished and all(c.finish_reason == "length" for c in r.outputs) for r in done)
    assert 30 <= len(done) < 40 and st.finished_by_reason["abort"] >= 1
    assert sum(st.finished_by_reason.values()) == sum(1 + i % 2 for i in range(40))  # every sample ended once
    assert st.swap_blocks_used == 0 and st.kv_blocks_free == st.kv_blocks_total and st.num_preemptions_total > 0


def test_shutdown_while_loading_never_starts_the_loop(stories_dir):
    async def main():
        llm = AsyncLLM(config(stories_dir))
        starting = asyncio.create_task(llm.start())
        await asyncio.sleep(0)  # the model is loading in its thread
        assert llm.state == "loading"
        with pytest.raises(EngineNotReadyError, match="loading"):
            await collect(llm, PROMPTS[0], GREEDY, "early")
        await llm.shutdown(1)
        await asyncio.wait_for(starting, 60)
        llm._thread.join(10)  # the engine thread loaded the model, then stopped without a step
        return llm.state, llm._thread, llm.engine

    state, thread, engine = asyncio.run(main())
    assert state == "stopped" and not thread.is_alive() and engine.last_step == StepStats()


def test_the_engine_is_built_and_stepped_in_one_thread(stories_dir, monkeypatch):
    """torch's OpenMP pool is per thread: an engine loaded in one thread and stepped in another leaves
    two pools in the process, more OpenMP threads than cores, and libgomp then sleeps between regions."""
    from quantkit.engine import llm_engine

    threads = {"init": set(), "step": set()}
    init, step = llm_engine.LLMEngine.__init__, llm_engine.LLMEngine.step

    def traced_init(self, *a, **k):
        threads["init"].add(threading.get_ident())
        init(self, *a, **k)

    def traced_step(self, *a, **k):
        threads["step"].add(threading.get_ident())
        return step(self, *a, **k)

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", traced_init)
    monkeypatch.setattr(llm_engine.LLMEngine, "step", traced_step)

    async def main():
        llm = AsyncLLM(config(stories_dir))
        await llm.start()
        await collect(llm, PROMPTS[0], GREEDY, "r")
        await llm.shutdown(5)
        return llm._thread.ident

    engine_thread = asyncio.run(main())
    assert threads == {"init": {engine_thread}, "step": {engine_thread}}
