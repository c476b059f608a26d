"""Waits on a pdkv router with nothing but the Python standard library (the job runs in images without curl).

    python deploy/router_check.py health URL [--timeout-s 600] [--pid PID]
    python deploy/router_check.py pools URL [--timeout-s 60]

`health` polls GET URL/health until it answers 200; it gives up after `--timeout-s`, or as soon as
the process `--pid` (the `pd.launch` that owns the router) has exited. `pools` polls
GET URL/pd/workers?refresh=1 until every healthy worker's KV pool audit says all free and
consistent; it sends `Authorization: Bearer $PDKV_ADMIN_KEY` (router.admin_key: /pd/* takes that key
alone), else $PDKV_API_KEY, when set. Each HTTP call has its own 5 s timeout. Exit status: 0 when the
state was reached, 1 otherwise, 3 when the router refused the audit (401/403: no key that opens /pd/*),
the reason on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

HTTP_TIMEOUT_S = 5.0
POLL_S = 1.0


REFUSED = 3


def _get(url: str, admin: bool = False) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    key = (admin and os.environ.get("PDKV_ADMIN_KEY")) or os.environ.get("PDKV_API_KEY")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (OSError, ValueError):  # refused, reset, timed out, not resolvable: not up yet
        return 0, b""


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_healthy(base_url: str, timeout_s: float, pid: int | None) -> str | None:
    deadline = time.monotonic() + timeout_s
    while True:
        status, _ = _get(f"{base_url}/health")
        if status == 200:
            return None
        if not _alive(pid):
            return f"the process {pid} exited before the router at {base_url} came up"
        if time.monotonic() > deadline:
            return f"router at {base_url} not healthy after {timeout_s:.0f} s (last status {status or 'no answer'})"
        time.sleep(POLL_S)


class Refused(Exception):
    """The router refused the request for its key (401/403)."""


def wait_pools_free(base_url: str, timeout_s: float) -> str | None:
    deadline = time.monotonic() + timeout_s
    audits: dict = {}
    while True:
        status, body = _get(f"{base_url}/pd/workers?refresh=1", admin=True)
        if status in (401, 403):
            raise Refused(f"{base_url}/pd/workers answered {status}: set PDKV_ADMIN_KEY (router.admin_key)")
        if status == 200:
            reports = json.loads(body)
            audits = {wid: r.get("stats", {}).get("audit", {}) for wid, r in reports.items() if r.get("healthy")}
            if audits and all(a.get("all_free") and a.get("consistent") for a in audits.values()):
                print(f"KV pools after the run: all free ({len(audits)} workers audited)", flush=True)
                return None
        if time.monotonic() > deadline:
            return f"KV pools not all free after {timeout_s:.0f} s (status {status}): {json.dumps(audits)[:2000]}"
        time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("health", "pools"))
    parser.add_argument("url", help="the router's base URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("--timeout-s", type=float, default=None, help="default: 600 (health), 60 (pools)")
    parser.add_argument("--pid", type=int, default=None, help="health: stop waiting once this process has exited")
    args = parser.parse_args(argv)
    base_url = args.url.rstrip("/")
    if args.what == "health":
        error = wait_healthy(base_url, 600.0 if args.timeout_s is None else args.timeout_s, args.pid)
    else:
        try:
            error = wait_pools_free(base_url, 60.0 if args.timeout_s is None else args.timeout_s)
        except Refused as exc:
            print(f"router_check: {exc}", file=sys.stderr)
            return REFUSED
    if error:
        print(f"router_check: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
