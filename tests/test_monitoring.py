"""deploy/k8s/base/monitoring: the Grafana dashboard and the Prometheus alerting rules read only
metrics the services export; the rules pass `promtool check rules`; and (slow) a real Prometheus
server scraping a local stack under load answers every dashboard query with data and loads
every rule."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml

from coordinator.launch import LocalStack
from coordinator.metrics import CoordinatorMetrics
from model_service.metrics import ModelMetrics
from model_service.sessions import SessionTable
from runtime.ports import free_port
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.services.test_metrics import eventually

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "base" / "monitoring"
DASHBOARD = MONITORING / "specdec-dashboard.json"
RULES = MONITORING / "specdec-alerts.yaml"
SUFFIXES = {"counter": ["_total", "_created"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count", "_created"]}
MADE_BY_PROMETHEUS = {"up"}  # series Prometheus makes for each scrape target


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every dashboard query, Grafana's $__rate_interval as 30s."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"].replace("$__rate_interval", "30s")) for p in panels for t in p.get("targets", [])]


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def exported() -> set[str]:
    """Every sample name the coordinator and the model services can export."""
    names = set()
    model = ModelMetrics()
    model.watch(SessionTable(1, 1.0, keep_positions=1))  # (a service that keeps finished sessions' caches)
    for metrics in (CoordinatorMetrics(), model):
        for family in metrics.registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers followed by a selector, a range or the
    end of a term, not function names, label names or keywords."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_labels = re.sub(r"\{[^}]*\}", "{}", without_strings)
    without_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", without_labels)
    return {m.group(1) for m in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", without_groupings)
            if m.group(1) not in {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                                  "group_right", "offset", "bool"} and not re.fullmatch(r"\d+[smhd]?", m.group(1))}


def test_every_query_reads_a_metric_the_services_export():
    known = exported() | MADE_BY_PROMETHEUS
    queries = dashboard_queries() + [(rule["alert"], rule["expr"]) for rule in rules()]
    assert len(queries) >= 25
    unknown = {(title, name) for title, expr in queries for name in metric_names(expr) if name not in known}
    assert not unknown, unknown
    read = {name for _, expr in queries for name in metric_names(expr)}
    for needed in ("specdec_time_to_first_token_seconds_bucket", "specdec_inter_token_seconds_bucket",
                   "specdec_accepted_tokens_per_pos_total", "specdec_queue_depth", "specdec_batch_size_sum",
                   "specdec_kv_cache_tokens", "specdec_model_calls_total", "specdec_propose_seconds_bucket",
                   "specdec_verify_seconds_bucket", "specdec_active_sessions", "specdec_prefix_cache_hit_tokens_total",
                   "up"):
        assert needed in read, needed


def test_the_name_check_catches_a_metric_nobody_exports():
    assert metric_names('sum by (instance) (rate(specdec_nope_total{status!="OK"}[5m])) / on() up') == {
        "specdec_nope_total", "up"}
    assert "specdec_nope_total" not in exported()


def test_each_alert_says_what_it_is():
    found = rules()
    assert {r["alert"] for r in found} >= {"SpecdecAcceptanceCollapse", "SpecdecRequestErrors", "SpecdecQueueGrowing",
                                           "SpecdecReplicaDown"}
    for rule in found:
        assert rule["expr"].strip() and rule["for"] and rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_rules_pass_promtool():
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed here (make prometheus installs Debian's prometheus package)")
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def _query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def _load(stack, stop_at: float) -> None:
    """Bounded load: greedy and sampled requests, streamed and not, one refused, until stop_at."""
    with grpc.insecure_channel(stack.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for i in range(40):
            if time.monotonic() > stop_at:
                return
            request = pb.GenerateRequest(prompt="def f(x):", max_new_tokens=16, temperature=0.0 if i % 2 else 0.8,
                                         seed=i, num_speculative_tokens=3)
            if i % 3:
                stub.Generate(request)
            else:
                list(stub.GenerateStream(request))
        with pytest.raises(grpc.RpcError):
            stub.Generate(pb.GenerateRequest(prompt="x", temperature=-1.0))  # INVALID_ARGUMENT, counted


@pytest.mark.slow
def test_a_real_prometheus_answers_every_dashboard_query(pair, tmp_path):
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed here (make prometheus installs Debian's package)")
    _, target = pair  # the target drafting for itself: every position accepts, so each series exists
    ports = {role: free_port() for role in ("draft", "target", "coordinator")}
    stack = LocalStack(target, target, draft_args=["--metrics-port", str(ports["draft"])],
                       target_args=["--metrics-port", str(ports["target"])],
                       coordinator_args=["--metrics-port", str(ports["coordinator"])]).start()
    web = free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(RULES)],
              "scrape_configs": [{"job_name": f"specdec-{role}", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                                 for role, port in ports.items()]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{web}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with grpc.insecure_channel(stack.target_addrs[0]) as channel:  # a model call that fails: NOT_FOUND
            with pytest.raises(grpc.RpcError):
                pb_grpc.TargetStub(channel).Verify(pb.VerifyRequest(session_id="nobody"))
        stop_at = time.monotonic() + 40
        with ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(_load, stack, stop_at) for _ in range(2)]:
                done.result()
        def every_query_has_data() -> None:  # (once a scrape after the load has landed)
            try:
                missing = [(title, expr) for title, expr in dashboard_queries() if not _query(web, expr)]
            except OSError as e:  # (the server still starting)
                raise AssertionError(e) from e
            assert not missing, missing

        eventually(every_query_has_data, timeout=60)
        groups = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/rules", timeout=10).read())
        loaded = [r for g in groups["data"]["groups"] for r in g["rules"]]
        assert len(loaded) == len(rules()) and all(r["health"] in {"ok", "unknown"} for r in loaded), loaded
    finally:
        server.terminate()
        server.wait(30)
        stack.stop()
