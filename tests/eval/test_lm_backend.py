"""The backend is registered with lm-eval and builds from lm-eval's model_args string."""

import pytest

from quantkit.eval.lm_backend import QuantkitLM, continuation_score


def test_registered_and_built_from_arg_string(tiny_llama):
    from lm_eval.api.registry import get_model

    cls = get_model("quantkit")
    assert cls is QuantkitLM
    # as lm-eval's CLI calls it: model_args plus batch_size / max_batch_size / device
    lm = cls.create_from_arg_string(f"pretrained={tiny_llama},max_length=128",
                                    {"batch_size": 4, "max_batch_size": 64, "device": "cpu"})
    assert lm.max_length == 128 and lm._batch_size == 4
    (ll, greedy), = lm._loglikelihood_tokens([(("a", "b"), [1, 5, 9], [7])])
    assert ll < 0 and isinstance(greedy, bool)
    assert lm.forwards == 1


def test_shared_inputs_share_one_forward(tiny_llama):
    lm = QuantkitLM(pretrained=str(tiny_llama))
    ctx = [1, 5, 9, 11]
    out = lm._loglikelihood_tokens([((None, None), ctx, [c]) for c in (20, 21, 22, 23)])
    assert lm.forwards == 1  # MMLU's four one-token answers: one forward
    solo = [QuantkitLM(model=lm.model, tokenizer=lm.tokenizer)._loglikelihood_tokens([((None, None), ctx, [c])])[0]
            for c in (20, 21, 22, 23)]
    assert [ll for ll, _ in out] == pytest.approx([ll for ll, _ in solo], abs=1e-5)
    assert sum(greedy for _, greedy in out) <= 1


def test_truncation_is_counted_once_per_context(tiny_llama):
    lm = QuantkitLM(pretrained=str(tiny_llama), max_length=8)
    long_ctx = list(range(3, 20))
    lm._loglikelihood_tokens([((None, None), long_ctx, [c]) for c in (30, 31)] + [((None, None), [1, 2], [30])])
    assert len(lm.truncated_contexts) == 1


def test_continuation_score():
    import torch

    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]]), -1)
    ll, greedy = continuation_score(logprobs, (0, 2))  # read at the last two positions
    assert ll == pytest.approx(float(logprobs[1, 0] + logprobs[2, 2]))
    assert greedy
    assert not continuation_score(logprobs, (1,))[1]


def test_the_backend_picks_the_device_that_is_there(tiny_llama):
    import torch

    lm = QuantkitLM(pretrained=str(tiny_llama))  # no device given
    assert lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("given, expected", [([], ["--device", "auto"]), (["--device", "cpu"], ["--device", "cpu"]),
                                             (["--device=cpu"], ["--device=cpu"])])
def test_quantkit_lm_eval_asks_for_auto_unless_a_device_is_given(monkeypatch, given, expected):
    # lm-eval's own default is cuda:0, which dies on a machine without CUDA
    import sys

    import lm_eval.__main__

    from quantkit.eval.lm_eval_cli import main

    seen = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["quantkit-lm-eval", "run", "--model", "quantkit", *given])
    main()
    assert seen[0][-len(expected):] == expected and seen[0].count("--device") + seen[0].count("--device=cpu") == 1
