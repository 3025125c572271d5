"""The stats board (cluster/deployments.py's StatsBoard) as plain Python: what it keeps."""

from __future__ import annotations

import asyncio

from justllm.cluster import deployments
from justllm.cluster.deployments import STALE, StatsBoard


def test_a_replica_that_stopped_reporting_leaves_the_board_at_the_next_report(monkeypatch):
    """Rows of replicas that died (each with a whole /metrics page) were dropped only when
    someone read the board: under autoscaling churn with nobody looking they piled up."""
    now = [100.0]
    monkeypatch.setattr(deployments.time, "monotonic", lambda: now[0])
    board = StatsBoard({})

    async def main() -> None:
        await board.report({"model": "m", "replica": "old"}, "page " * 1000)
        now[0] += STALE + 1
        await board.report({"model": "m", "replica": "new"}, "page")
        assert list(board._rows["m"]) == ["new"]
        assert list((await board.snapshot())["m"]) == ["new"]

    asyncio.run(main())
