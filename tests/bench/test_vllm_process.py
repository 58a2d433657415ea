"""The vLLM subprocess driver's reading of vLLM's log (its start, jobs and failures run in
test_engine_vs_vllm.py, against a venv that fails and, with the interop marker, the real vLLM CPU build)."""

from quantkit.bench.vllm_process import VLLM


def test_vllm_kernel_choices_come_from_its_log(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("(MainProcess pid=1) INFO 12-03 12:06:22 [core.py:133] Initializing ... kernel_config=...\n"
                   "(MainProcess pid=1) INFO 12-03 12:06:22 [__init__.py:923] Using CPUWNA16LinearKernel for "
                   "mixed-precision linear\n"
                   "(MainProcess pid=1) INFO 12-03 12:06:22 [auto_gptq.py:352] Using CPUWNA16LinearKernel for "
                   "AutoGPTQLinearMethod\n"
                   "(MainProcess pid=1) INFO 12-03 12:06:22 [__init__.py:923] Using CPUWNA16LinearKernel for "
                   "mixed-precision linear\n")
    vllm = VLLM.__new__(VLLM)  # only its log: no process
    vllm.log = log
    assert vllm.kernels() == ["Using CPUWNA16LinearKernel for AutoGPTQLinearMethod",
                              "Using CPUWNA16LinearKernel for mixed-precision linear"]
