"""Load and faults at once (issue 13), on real Ray actors over real HTTP and ZMQ (1P2D):
streaming clients while a decode worker is SIGKILLed, junk connections are held on P's data
port, unauthenticated REFUSE frames arrive on its side channel, idle connections are held on the
router, never-reading subscribers (half with the secret, half without) sit on P's KV event stream
and a client sends poisoned sampling values. Every request is answered (200, or 429/503 with
Retry-After), none hangs, every 200 is token-identical to the undisturbed run, every poisoned
request ends 200 with all its tokens, no worker but the killed one leaves the rotation, P never
admits subscribers past its cap, RSS stays bounded and the surviving pools end all free.

The default suite runs a small version (40 clients, 6 s); `-m slow` the acceptance run
(300 clients, 20 s), the same as `python -m pd.tools.load_faults`.
"""
from __future__ import annotations


import pytest

from tests.helpers.e2e import wait_all_free

from pd.deploy.launch import Deployment
from pd.tools.load_faults.cli import LoadFaultsSettings, default_config, run_load_faults
from pd.tools.load_faults.driver import DriverSpec
from pd.tools.load_faults.injectors import POISONED
from pd.tools.load_faults.report import LoadFaultsReport, RSSTrack

# streams of 48 tokens, killed 3 s in: on a loaded 2-core machine some are mid-stream then
SMALL = LoadFaultsSettings(num_clients=40, duration_s=6.0, kill_after_s=3.0, num_junk=20, refuse_rate=200.0,
                           num_router_idle=500, num_event_subscribers=20, num_poisoned=12, num_prompts=12,
                           max_tokens=48)


def run_and_check(settings: LoadFaultsSettings, fault_record) -> LoadFaultsReport:
    with Deployment(default_config().replace(topology__cpus_per_worker=0.1)) as dep:
        report = run_load_faults(dep, settings)
        assert report.failures() == [], report.format()
        statuses = report.statuses()
        assert set(statuses) <= {"200", "429", "503"}, statuses
        served = statuses.get("200", 0)
        assert served > 0 and report.num_identical() == served, report.format()
        assert report.victim_in_flight_at_kill > 0 and report.num_migrations + report.num_redispatches > 0, \
            "the kill landed on an idle worker"
        assert report.rss[settings.victim].after_mb is None  # it really died
        assert report.refused_counted.get("other", 0) == report.refuse_sent > 0  # one bounded bucket
        assert report.metrics_lines[1] <= report.metrics_lines[0] + 20, report.metrics_lines
        assert report.junk["opened"] >= settings.num_junk
        # the idle connections on the router were held beside the load, never past its cap
        assert report.router_idle["opened"] >= settings.num_router_idle, report.router_idle
        assert report.router_idle["router"]["open"] <= report.router_idle["router"]["max_connections"]
        # every poisoned request (each kind of value once at least) was served, no worker but the victim went out
        assert len(report.poisoned) == settings.num_poisoned and report.poisoned_figures()["kinds"] >= min(
            settings.num_poisoned, len(POISONED)), report.poisoned_figures()
        assert all(p["status"] == 200 and p["num_tokens"] == p["want_tokens"] > 0 for p in report.poisoned)
        assert set(report.left_rotation) == {settings.victim}, report.left_rotation
        # the never-reading subscribers: none without the secret got through, the cap held, the rest refused
        subs, worker = report.event_subscribers, report.event_subscribers["worker"]
        assert subs["opened"] == settings.num_event_subscribers and subs["admitted_plain"] == 0, subs
        assert 0 < worker["peak_subscribers"] <= worker["max_subscribers"], worker
        assert worker["refused"] >= subs["with_secret"] + worker["before_subscribers"] - worker["max_subscribers"] > 0
        reports = wait_all_free(dep.url)
        assert reports[settings.victim]["healthy"] is False
    rss = ", ".join(f"{'router (in the test process)' if name == 'router' else name} {t.before_mb:.0f}/"
                    f"{t.peak_mb:.0f}/" + (f"{t.after_mb:.0f}" if t.after_mb else "gone")
                    for name, t in report.rss.items())
    fault_record(fault=f"load + faults: {settings.num_clients} clients for {settings.duration_s:.0f}s, D SIGKILLed, "
                       f"{settings.num_junk} junk data connections, REFUSE frames at {settings.refuse_rate:.0f}/s, "
                       f"{settings.num_router_idle} idle router connections, {settings.num_event_subscribers} "
                       f"never-reading KV event subscribers, {settings.num_poisoned} poisoned-sampling requests (1P2D)",
                 where="router, D worker, P data port / side channel",
                 user_saw=f"{len(report.rows)} requests: {statuses}, all 429/503 with Retry-After, none hung; "
                          f"{report.num_identical()}/{served} served token-identical; poisoned: "
                          f"{report.poisoned_figures()['final_statuses']}",
                 pdkv_did=f"{report.num_migrations} streams migrated, {report.num_redispatches} re-dispatched; "
                          f"{report.refuse_sent} REFUSEs counted under 'other'; P admitted "
                          f"{worker['peak_subscribers']}/{worker['max_subscribers']} subscribers, refused "
                          f"{worker['refused']}; RSS MiB before/peak/after: {rss} "
                          f"({report.seconds:.0f}s)",
                 pools="all free (surviving P, D)")
    return report


def test_load_and_faults_at_once(ray_instance, fault_record):
    run_and_check(SMALL, fault_record)


@pytest.mark.slow
def test_load_and_faults_at_once_300_clients_20s(ray_instance, fault_record):
    run_and_check(LoadFaultsSettings(), fault_record)


def _row(prompt=0, status=200, tokens=(1, 2), retry_after=None, done=True, errors=(), hung=False):
    return {"prompt": prompt, "status": status, "retry_after": retry_after, "token_ids": list(tokens),
            "errors": list(errors), "done": done, "hung": hung, "exception": None, "seconds": 0.1}


def test_report_names_every_broken_promise():
    good = [_row(), _row(status=429, tokens=(), retry_after="1"), _row(status=503, tokens=(), retry_after="1")]
    ok = LoadFaultsReport(num_clients=1, duration_s=1, rows=good, reference=[[1, 2]],
                          rss={"router": RSSTrack(1, 100.0, 120.0, 110.0)}, max_rss_growth_mb=50.0,
                          pools={"decode-1": {"all_free": True}})
    assert ok.failures() == [] and ok.num_identical() == 1 and ok.format().endswith("PASS")
    bad = LoadFaultsReport(num_clients=1, duration_s=1, reference=[[1, 2]],
                           rows=[_row(tokens=(1, 3)), _row(done=False), _row(errors=["lost"]),
                                 _row(status=503, tokens=()), _row(status=500, tokens=()),
                                 _row(status=None, tokens=(), hung=True)],
                           rss={"router": RSSTrack(1, 100.0, 400.0, 110.0)}, max_rss_growth_mb=50.0,
                           pools={"decode-1": {"all_free": False, "detail": "3 blocks held"}}, victim="decode-0",
                           poisoned=[{"values": {"top_p": 1e-320}, "status": 500, "attempts": [500], "num_tokens": 0,
                                      "want_tokens": 6, "error": "engine step loop died"},
                                     {"values": {"temperature": 1e-300}, "status": 200, "attempts": [200],
                                      "num_tokens": 6, "want_tokens": 6, "error": None}],
                           left_rotation={"decode-0": 3.0, "prefill-0": 4.2},
                           event_subscribers={"opened": 4, "with_secret": 2, "plain": 2, "connected": 4,
                                              "admitted": 2, "admitted_plain": 0, "handshakes_failed": {},
                                              "worker": {"peak_subscribers": 9, "max_subscribers": 8}})
    problems = "\n".join(bad.failures())
    for words in ("2 requests not answered", "1 429/503 answers without Retry-After", "3 answers with status 200",
                  "RSS of router grew by 300 MiB", "3 blocks held", "1 of 2 poisoned-sampling requests",
                  "besides decode-0: ['prefill-0']", "held 9 subscribers, past its cap of 8"):
        assert words in problems, problems
    assert bad.statuses() == {"200": 3, "500": 1, "503": 1, "hung": 1}


def test_settings_and_driver_spec_refuse_bad_input():
    with pytest.raises(ValueError, match="kill_after_s"):
        LoadFaultsSettings(duration_s=5, kill_after_s=5)
    with pytest.raises(ValueError, match="num_poisoned"):
        LoadFaultsSettings(num_poisoned=-1)
    with pytest.raises(ValueError, match="num_clients"):
        LoadFaultsSettings(num_clients=0)
    with pytest.raises(ValueError, match="unknown field.*clients"):
        DriverSpec.from_json('{"url": "http://x", "prompts": ["a"], "max_tokens": 1, "num_clients": 1, '
                             '"duration_s": 1, "request_timeout_s": 1, "clients": 3}')
