"""AsyncLLM on stories260K: streaming equals the offline engine, cancellation aborts and frees every
block, the queue bound, failures that fail their requests or kill the engine (never a hang), and
shutdown's drain. Plain tests around `asyncio.run`; every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from quantkit.engine import LLM, EngineConfig, SamplingParams
from quantkit.engine.async_llm import AsyncLLM, EngineDeadError, EngineNotReadyError, QueueFullError
from quantkit.errors import QuantkitError

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a bird"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
ENDLESS = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def config(stories_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(stories_dir), max_model_len=512, **{"max_num_seqs": 8, **kw})


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
    expected = [o.outputs[0] for o in LLM(str(stories_dir), max_model_len=512).generate(PROMPTS, GREEDY)]

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
        assert [len(o.outputs[0].token_ids) for o in stream] == list(range(1, len(stream) + 1))


def test_cancelled_and_abandoned_consumers_abort_their_requests(stories_dir):
    async def main():
        llm = AsyncLLM(config(stories_dir))
        await llm.start()

        async def consume(rid):
            async for _ in llm.generate(PROMPTS[0], ENDLESS, rid):
                pass

        task = asyncio.create_task(consume("cancelled"))
        await wait_until(lambda: llm.num_running() == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await wait_until(lambda: all_blocks_free(llm))
        async with contextlib.aclosing(llm.generate(PROMPTS[1], ENDLESS, "broke")) as gen:
            async for out in gen:
                if len(out.outputs[0].token_ids) == 3:
                    break
        await wait_until(lambda: all_blocks_free(llm))
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
        short = asyncio.create_task(collect(llm, PROMPTS[0], GREEDY, "short"))
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
    assert drained.outputs[0].finish_reason == "length" and len(drained.outputs[0].token_ids) == 12
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort" and state == "dead"
