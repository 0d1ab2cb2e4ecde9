"""deploy/: every kustomization renders offline, every object is valid against a pinned Kubernetes
version (strict), and the pieces fit: probes, ports, selectors, autoscalers, flags."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from coordinator import launch
from coordinator.__main__ import parse_args as coordinator_args
from draft_service.__main__ import parse_args as draft_args
from target_service.__main__ import parse_args as target_args

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZATIONS = ["deploy/k8s/base", "deploy/k8s/overlays/cpu", "deploy/k8s/overlays/gpu",
                  "deploy/k8s/overlays/multihost"]
LWS = "leaderworkerset.x-k8s.io/v1"
# the part of LeaderWorkerSet's v1 schema these manifests use (sigs.k8s.io/lws, api/leaderworkerset/v1);
# unknown or misspelt fields fail, as they would in strict validation
LWS_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": LWS}, "kind": {"const": "LeaderWorkerSet"}, "metadata": {"type": "object"},
        "spec": {
            "type": "object", "additionalProperties": False, "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"type": {"enum": ["RollingUpdate"]}, "rollingUpdateConfiguration": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"maxUnavailable": {"type": ["integer", "string"]},
                                       "maxSurge": {"type": ["integer", "string"]}}}}},
                "leaderWorkerTemplate": {
                    "type": "object", "additionalProperties": False, "required": ["size", "workerTemplate"],
                    "properties": {"size": {"type": "integer", "minimum": 1},
                                   "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                                   "leaderTemplate": {"type": "object"}, "workerTemplate": {"type": "object"}}},
            },
        },
    },
}
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


def pod_templates(objects: list[dict]) -> list[tuple[str, dict, bool]]:
    """(owner name, pod template, whether it runs a gRPC service) of every workload: Deployments, and
    a LeaderWorkerSet's leader (the service) and workers (Ray only)."""
    found = [(d["metadata"]["name"], d["spec"]["template"], True) for d in by_kind(objects, "Deployment").values()]
    for name, lws in by_kind(objects, "LeaderWorkerSet").items():
        group = lws["spec"]["leaderWorkerTemplate"]
        found += [(name, group["leaderTemplate"], True), (name, group["workerTemplate"], False)]
    return found


def command_of(container: dict) -> list[str]:
    """[module, *flags] the container runs: its args, or the `exec python -m ...` of a shell line."""
    if container.get("command", [])[:2] != ["sh", "-c"]:
        return container["args"]
    words = shlex.split(container["args"][0])
    start = words.index("-m") + 1 if "python" in words else len(words)
    return words[start:]


def test_every_object_is_valid_kubernetes(objects):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in objects:
        if obj["apiVersion"] == LWS:  # a custom resource: its own schema, and its pod templates as Kubernetes'
            jsonschema = pytest.importorskip("jsonschema")
            jsonschema.validate(obj, LWS_SCHEMA)
            group = obj["spec"]["leaderWorkerTemplate"]
            for template in (group["leaderTemplate"], group["workerTemplate"]):
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                              "template": template}, KUBERNETES, strict=True)
            continue
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_each_component_scales_on_its_own(objects):
    workloads = {**by_kind(objects, "Deployment"), **by_kind(objects, "LeaderWorkerSet")}
    assert set(workloads) == {"specdec-coordinator", "specdec-draft", "specdec-target"}
    refs = {h["spec"]["scaleTargetRef"]["name"]: h["spec"]["scaleTargetRef"]
            for h in by_kind(objects, "HorizontalPodAutoscaler").values()}
    assert set(refs) == set(workloads)
    for name, ref in refs.items():
        assert (ref["apiVersion"], ref["kind"]) == (workloads[name]["apiVersion"], workloads[name]["kind"])
    assert by_kind(objects, "PodDisruptionBudget")["specdec-coordinator"]["spec"]["minAvailable"] >= 1


def test_a_multihost_target_is_one_tensor_parallel_group_per_replica():
    objects = render("deploy/k8s/overlays/multihost")
    lws = by_kind(objects, "LeaderWorkerSet")["specdec-target"]
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost rank recreates the whole group
    leader, worker = group["leaderTemplate"]["spec"]["containers"][0], group["workerTemplate"]["spec"]["containers"][0]
    gpus = int(leader["resources"]["limits"]["nvidia.com/gpu"])
    assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    env = {e["name"]: e["value"] for e in leader["env"] if "value" in e}
    assert int(env["SPECDEC_TARGET_TENSOR_PARALLEL_SIZE"]) == group["size"] * gpus  # one rank per GPU
    assert "ray start --head --port=6379" in leader["args"][0] and "--ray-address auto" in leader["args"][0]
    assert "--address=$(LWS_LEADER_ADDRESS):6379" in worker["args"][0] and "--block" in worker["args"][0]
    assert {p["containerPort"] for p in leader["ports"]} >= {6379, 50051}
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        container = template["spec"]["containers"][0]
        # both load the weights from the same volume
        assert any(m["mountPath"] == "/models" for m in container["volumeMounts"])
        # and join one Ray cluster with the same token (Ray refuses a peer without it)
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "specdec-ray-auth", "key": "token"}


def test_probes_are_grpc_on_the_ports_the_containers_serve(objects):
    for name, template, serves in pod_templates(objects):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert "limits" in c["resources"] and "requests" in c["resources"]
            if not serves:
                continue
            ports = {p["containerPort"] for p in c["ports"]}
            module, *flags = command_of(c)
            port = int(flags[flags.index("--port") + 1])
            assert port in ports
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert c[probe]["grpc"]["port"] == port, (name, probe)


def test_services_select_their_pods_and_pools_are_headless(objects):
    templates = pod_templates(objects)
    services = by_kind(objects, "Service")
    for name, svc in services.items():
        selected = [t for _, t, _ in templates if svc["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
        assert len(selected) == 1, name  # a multi-host target: the leaders only, never the Ray workers
        ports = {p["containerPort"] for p in selected[0]["spec"]["containers"][0]["ports"]}
        assert all(p["port"] in ports for p in svc["spec"]["ports"]), name
    assert services["specdec-draft"]["spec"]["clusterIP"] == "None"
    assert services["specdec-target"]["spec"]["clusterIP"] == "None"
    config = by_kind(objects, "ConfigMap")["specdec-config"]["data"]
    for role, port in (("DRAFT", 50052), ("TARGET", 50051)):  # the coordinator's pools name those Services
        host, _, p = config[f"SPECDEC_COORDINATOR_{role}"].rpartition(":")
        assert host == f"specdec-{role.lower()}" and int(p) == port


def test_args_and_settings_are_flags_the_services_take(objects, monkeypatch):
    config = by_kind(objects, "ConfigMap")["specdec-config"]["data"]
    for _, template, serves in pod_templates(objects):
        if not serves:
            continue
        c = template["spec"]["containers"][0]
        module, *flags = command_of(c)
        env = {**config, **{e["name"]: e["value"] for e in c.get("env", []) if "value" in e}}
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


def test_the_coordinator_serves_http_on_its_service_with_the_key_from_a_secret(objects):
    """The OpenAI-compatible port the coordinator is told to serve is a container port and a port of the
    public Service; its API key (both front doors) comes from a Secret, never from the manifests."""
    deployment = by_kind(objects, "Deployment")["specdec-coordinator"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    module, *flags = command_of(container)
    http = int(flags[flags.index("--http-port") + 1])
    assert http in {p["containerPort"] for p in container["ports"]}
    service = by_kind(objects, "Service")["specdec"]
    assert any(p["port"] == http and p.get("appProtocol") == "http" for p in service["spec"]["ports"])
    key = next(e for e in container["env"] if e["name"] == "SPECDEC_COORDINATOR_API_KEY")
    assert "value" not in key and key["valueFrom"]["secretKeyRef"]["name"] == "specdec-api-key"
    assert "--api-key" not in flags
    assert container["readinessProbe"]["grpc"]["port"] == int(flags[flags.index("--port") + 1])


def test_the_coordinator_is_ready_while_it_would_serve_and_live_while_it_is_up(objects):
    """Its readiness probe asks the Generation service's health (NOT_SERVING while no target replica is healthy:
    traffic goes to a coordinator that reaches a target), its liveness and start-up probes the server's (a
    coordinator whose targets are down is not restarted for it)."""
    from coordinator.server import SERVICE_NAME

    container = by_kind(objects, "Deployment")["specdec-coordinator"]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["grpc"].get("service") == SERVICE_NAME
    assert container["livenessProbe"]["grpc"].get("service", "") == ""
    assert container["startupProbe"]["grpc"].get("service", "") == ""


def test_the_cpu_overlay_drafts_as_make_run_does_from_models_the_image_holds():
    """The cpu overlay serves the shipped models from the image with the draft `make run` picks for them
    (the launcher's --draft-method auto: the EAGLE-3 head where its card beats the distilled draft's),
    and every /app/models/<name> it names is a directory the Dockerfile puts there."""
    config = by_kind(render("deploy/k8s/overlays/cpu"), "ConfigMap")["specdec-config"]["data"]
    method = config.get("SPECDEC_DRAFT_METHOD", "model")
    assert method == launch.draft_method("auto", None)
    assert config["SPECDEC_DRAFT_MODEL"] == "/app/models/" + ("eagle" if method == "eagle" else "draft")
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "WORKDIR /app\n" in dockerfile
    named = {v.removeprefix("/app/models/") for v in config.values() if v.startswith("/app/models/")}
    assert {"target", "draft" if method == "model" else "eagle"} <= named
    for name in named:
        assert f"COPY models/{name}/ models/{name}/" in dockerfile or f"--out models/{name}" in dockerfile, name
