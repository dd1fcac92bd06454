"""Where the transfer connector learns its DP rank: vLLM's own parallel config, as vLLM
leaves it in a dense model's DP engine (in a subprocess: vLLM imports slowly and warns)."""

from __future__ import annotations

from kvpool.testing.fresh import run_python


def test_a_dense_models_dp_engine_keeps_its_real_dp_rank() -> None:
    # vLLM runs a dense model's DP engines as independent engines and resets each one's
    # data_parallel_rank to 0; the connector must still give DP rank 1 its own ports.
    code = (
        "from vllm.config import ParallelConfig\n"
        "from kvpool.config.topology import rank_port\n"
        "from kvpool.connectors.transfer.connector import _dp_rank\n"
        "ranks = []\n"
        "for rank in range(2):\n"
        "    parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=rank)\n"
        "    parallel.reconfigure_for_independent_dp_rank()\n"
        "    assert parallel.data_parallel_rank == 0  # what vLLM leaves in the engine\n"
        "    ranks.append(_dp_rank(parallel))\n"
        "assert ranks == [0, 1], ranks\n"
        "assert [rank_port(30000, dp, 2, 0) for dp in ranks] == [30000, 30002]\n"
        "assert _dp_rank(ParallelConfig()) == 0\n"
        "print('ok')\n"
    )
    done = run_python(code)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr[-3000:]
