"""deploy/: every kustomization renders offline, every object is valid against a pinned Kubernetes
version (strict), and the pieces fit: probes, ports, selectors, autoscalers, flags."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from coordinator.__main__ import parse_args as coordinator_args
from draft_service.__main__ import parse_args as draft_args
from target_service.__main__ import parse_args as target_args

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZATIONS = ["deploy/k8s/base", "deploy/k8s/overlays/cpu", "deploy/k8s/overlays/gpu"]
KUBERNETES = "1.32"  # the version the manifests are validated against
PARSERS = {"coordinator": coordinator_args, "draft_service": draft_args, "target_service": target_args}
PREFIX = {"coordinator": "SPECDEC_COORDINATOR_", "draft_service": "SPECDEC_DRAFT_", "target_service": "SPECDEC_TARGET_"}


def render(path: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed here: cannot render the kustomizations")
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / path)], check=True, capture_output=True, text=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def objects(request) -> list[dict]:
    return render(request.param)


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_every_object_is_valid_kubernetes(objects):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_each_component_scales_on_its_own(objects):
    deployments, hpas = by_kind(objects, "Deployment"), by_kind(objects, "HorizontalPodAutoscaler")
    assert set(deployments) == {"specdec-coordinator", "specdec-draft", "specdec-target"}
    scaled = {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()}
    assert scaled == set(deployments)
    assert by_kind(objects, "PodDisruptionBudget")["specdec-coordinator"]["spec"]["minAvailable"] >= 1


def test_probes_are_grpc_on_the_ports_the_containers_serve(objects):
    for d in by_kind(objects, "Deployment").values():
        spec = d["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            ports = {p["containerPort"] for p in c["ports"]}
            module, *flags = c["args"]
            port = int(flags[flags.index("--port") + 1])
            assert port in ports
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert c[probe]["grpc"]["port"] == port, (d["metadata"]["name"], probe)
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert "limits" in c["resources"] and "requests" in c["resources"]


def test_services_select_their_pods_and_pools_are_headless(objects):
    deployments = by_kind(objects, "Deployment")
    services = by_kind(objects, "Service")
    for name, svc in services.items():
        selected = [d for d in deployments.values()
                    if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, name
        ports = {p["containerPort"] for p in selected[0]["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert all(p["port"] in ports for p in svc["spec"]["ports"]), name
    assert services["specdec-draft"]["spec"]["clusterIP"] == "None"
    assert services["specdec-target"]["spec"]["clusterIP"] == "None"
    config = by_kind(objects, "ConfigMap")["specdec-config"]["data"]
    for role, port in (("DRAFT", 50052), ("TARGET", 50051)):  # the coordinator's pools name those Services
        host, _, p = config[f"SPECDEC_COORDINATOR_{role}"].rpartition(":")
        assert host == f"specdec-{role.lower()}" and int(p) == port


def test_args_and_settings_are_flags_the_services_take(objects, monkeypatch):
    config = by_kind(objects, "ConfigMap")["specdec-config"]["data"]
    for d in by_kind(objects, "Deployment").values():
        c = d["spec"]["template"]["spec"]["containers"][0]
        module, *flags = c["args"]
        env = {**config, **{e["name"]: e["value"] for e in c.get("env", [])}}
        mine = {k: v for k, v in env.items() if k.startswith(PREFIX[module])}
        assert mine, module
        for key, value in mine.items():
            monkeypatch.setenv(key, value)
        args = PARSERS[module](flags)  # exits (fails the test) on an unknown flag or a bad value
        for key in mine:
            flag = key.removeprefix(PREFIX[module]).lower()
            assert hasattr(args, flag), f"{key} sets no flag of {module}"
        for key in mine:
            monkeypatch.delenv(key)
