"""The pool audit after a run counts the workers it expected (`pd.deploy.pool_audit`).

Real P/D workers and the real router in this process: an audit that reaches both says
"2 of 2" and is clean; with the prefill worker's HTTP API gone it reaches one of two, is not
clean and names the unreachable worker and why; a router with no worker at all (an audit of
nothing) is never clean.
"""
from __future__ import annotations

import asyncio

import requests

from pd.deploy.pool_audit import PoolAuditReport, audit_once
from pd.router.server import Router
from rel_deploy import SECRET, LocalDeployment, local_config

HTTP_TIMEOUT_S = 60


def test_audit_counts_expected_workers_and_names_the_unreachable():
    with LocalDeployment(local_config()) as dep:
        assert dep.router is not None
        resp = requests.post(f"{dep.url}/v1/completions", timeout=HTTP_TIMEOUT_S,
                             json={"prompt": "audit me", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        dep.wait_all_free()
        report = dep.run(audit_once(dep.router))
        assert report.clean and report.expected == ["prefill-0", "decode-0"], report
        assert report.lines() == ["KV pools after the run: all free (2 of 2 workers audited)"]
        assert dep.router.pool.get("decode-0").stats["audit"] == report.audits["decode-0"]  # the pool saw it too

        prefill_url = dep.router.pool.get("prefill-0").endpoint.url
        dep.run(dep.workers["prefill-0"].stop())  # its HTTP API is gone
        report = dep.run(audit_once(dep.router))
        assert not report.clean and not report.complete and not report.leaks, report
        assert list(report.audits) == ["decode-0"] and report.audits["decode-0"]["all_free"]
        lines = report.lines()
        assert lines[0] == "KV pools after the run: NOT verified (1 of 2 workers audited)", lines
        assert len(lines) == 2 and lines[1].startswith("  prefill-0: unreachable: ") and prefill_url in lines[1], lines
        del dep.workers["prefill-0"]  # stopped already


def test_an_audit_of_nothing_is_not_clean():
    router = Router(local_config(), [], SECRET)

    async def audit() -> PoolAuditReport:
        await router.client.open()
        try:
            return await audit_once(router)
        finally:
            await router.client.close()

    report = asyncio.run(audit())
    assert not report.clean and report.lines() == ["KV pools after the run: NOT verified (0 of 0 workers audited)"]
