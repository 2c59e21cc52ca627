"""deploy/kubernetes: the manifests agree with tierstore's CLI, its config and the trainer, build
with kustomize, and validate against the Kubernetes schemas (strict: unknown fields rejected)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate.utils import latest_version, validate

from tests.deploy import shell
from tests.deploy.contract import (
    ALL_INTERFACES,
    DRILL_FLAGS,
    check_batch_fits,
    check_torchrun_args,
    check_trainer_args,
    config,
    node_local_prefixes,
    parse_tierstore,
    trainer_flags,
)
from tests.deploy.pod_security import BASELINE, RESTRICTED, violations
from tests.deploy.tools import DEPLOY, assert_shellcheck_clean, system_tool

K8S = DEPLOY / "kubernetes"
BASE = K8S / "base"
DRILL = K8S / "components" / "restore-drill"
RUN_DIR_VOLUME = K8S / "components" / "run-dir-volume"
OVERLAYS = {"base": BASE} | {d.name: d for d in sorted((K8S / "overlays").iterdir()) if d.is_dir()}
"""The base and every shipped overlay (a new overlay is checked by every test below)."""
K8S_VERSIONS = ["1.33", latest_version()]
"""1.33: native sidecars (init containers with restartPolicy: Always) are GA."""
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
CRDS = {"PodMonitor"}
"""Kinds whose schema is a CRD's, not Kubernetes's: checked by the tests below instead."""

Doc = dict[str, Any]


def load(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(folder: Path) -> Doc:
    (doc,) = load(folder / "kustomization.yaml")
    return doc


def base_docs() -> list[Doc]:
    """The base's resources, read directly (no kubectl needed)."""
    return [d for name in kustomization(BASE)["resources"] for d in load(BASE / name)]


def job() -> Doc:
    (found,) = [d for d in base_docs() if d["kind"] == "Job"]
    return found


def pod() -> Doc:
    spec: Doc = job()["spec"]["template"]["spec"]
    return spec


def container(name: str) -> Doc:
    (found,) = [c for c in pod().get("initContainers", []) + pod()["containers"] if c["name"] == name]
    return found


def mounts(c: Doc) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c["volumeMounts"]}


def volume(name: str) -> Doc:
    (found,) = [v for v in pod()["volumes"] if v["name"] == name]
    return found


def env(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c["env"]}


def promoter_args() -> Any:
    return parse_tierstore(container("promoter")["command"][1:])


def metrics_port() -> int:
    port = promoter_args().metrics_port
    assert isinstance(port, int)
    return port


def named_port(c: Doc, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return int(number)


def config_mount(c: Doc) -> str:
    """Where the config ConfigMap is mounted in a container, with the config's file name."""
    (path,) = [p for p, name in mounts(c).items() if name == "config"]
    return f"{path}/tierstore.yaml"


def trainer_script() -> str:
    return (BASE / "train.sh").read_text()


def trainer_env() -> dict[str, str]:
    """The trainer's environment as train.sh sees it (downward-API values stand in as 0)."""
    values = {n: str(e.get("value", "0")) for n, e in env(container("trainer")).items()}
    return shell.assignments(trainer_script(), values)


def test_the_promoter_is_a_native_sidecar_running_tierstore_promote() -> None:
    promoter = container("promoter")
    assert promoter in pod()["initContainers"] and promoter.get("restartPolicy") == "Always"
    assert promoter["command"][0] == "tierstore"
    args = promoter_args()
    assert args.command == "promote" and not args.once
    assert args.metrics_addr == ALL_INTERFACES, "Prometheus scrapes from another pod"
    assert args.config == config_mount(promoter)


def test_every_metrics_port_is_the_promoters() -> None:
    promoter, port = container("promoter"), metrics_port()
    probes = {kind: promoter[kind]["httpGet"] for kind in ("livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert {named_port(promoter, p["port"]) for p in probes.values()} == {port}
    annotations = job()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port
    (monitor,) = load(K8S / "components" / "podmonitor" / "podmonitor.yaml")
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [named_port(promoter, e["port"]) for e in endpoints] == [port]
    labels = job()["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_node_local_tiers_are_mounted_where_the_config_puts_them() -> None:
    prefixes = node_local_prefixes()
    for name in ("promoter", "trainer"):
        at = mounts(container(name))
        assert at.get(prefixes["memory"]) == "memory-tier", f"{name}: memory tier not mounted"
        assert at.get(prefixes["local"]) == "nvme", f"{name}: local tier not mounted"
    assert volume("memory-tier")["emptyDir"]["medium"] == "Memory"
    # Directory, not DirectoryOrCreate: without the NVMe mounted the pod must not start (it would
    # fill the node's root disk).
    assert volume("nvme")["hostPath"]["type"] == "Directory"


def test_the_config_comes_from_the_generated_configmap() -> None:
    (generator,) = kustomization(BASE)["configMapGenerator"]
    assert volume("config")["configMap"]["name"] == generator["name"]
    assert "tierstore.yaml" in generator["files"] and "train.sh" in generator["files"]
    assert container("trainer")["command"][-1] == str(
        Path(config_mount(container("trainer"))).parent / "train.sh"
    )


def test_both_containers_know_the_node_index_and_the_s3_credentials() -> None:
    secret_keys = set(load(BASE / "secret.example.yaml")[0]["stringData"])
    for name in ("promoter", "trainer"):
        variables = env(container(name))
        assert variables["TIERSTORE_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3"):
            ref = variables[key]["valueFrom"]["secretKeyRef"]
            assert ref["key"] == key and key in secret_keys
            assert ref.get("optional", False) == (key == "AWS_ENDPOINT_URL_S3")
    spec = job()["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(trainer_env()["NNODES"])


def test_the_secret_is_an_example_without_credentials() -> None:
    (secret,) = load(BASE / "secret.example.yaml")
    assert "secret.example.yaml" not in kustomization(BASE)["resources"]
    values = secret["stringData"]
    assert values["AWS_ACCESS_KEY_ID"] == values["AWS_SECRET_ACCESS_KEY"] == "REPLACE-ME"


def test_the_trainer_runs_train_gpt_with_its_documented_flags() -> None:
    script, variables = trainer_script(), trainer_env()
    undefined = shell.variables(script) - set(variables)
    assert not undefined, f"train.sh uses {sorted(undefined)}, not set in the trainer's env"
    argvs = shell.commands(script, variables)
    (torchrun,) = shell.invocations(argvs, "torchrun")
    parsed, trainer_args = check_torchrun_args(torchrun)
    assert parsed.training_script == "/opt/tierstore/examples/train_gpt.py"
    assert parsed.node_rank == int(variables["TIERSTORE_NODE"])  # GROUP_RANK = TIERSTORE_NODE
    check_trainer_args(trainer_args, config_mount(container("trainer")))
    check_batch_fits(trainer_args, int(parsed.nnodes) * int(parsed.nproc_per_node))
    assert "SIGTERM" in parsed.signals_to_handle.split(",")
    (drain,) = shell.invocations(argvs, "tierstore")
    args = parse_tierstore(drain)
    assert args.command == "promote" and args.once
    assert args.config == config_mount(container("trainer"))


def test_the_stop_fits_the_grace_period_of_a_reclaimed_spot_vm() -> None:
    argvs = shell.commands(trainer_script(), trainer_env())
    (torchrun,) = shell.invocations(argvs, "torchrun")
    parsed, _ = check_torchrun_args(torchrun)
    (bounded,) = shell.invocations(argvs, "timeout")
    kill_after = int(bounded[0].removeprefix("--kill-after="))
    drain = int(bounded[1])
    assert bounded[2] == "tierstore", "the drain is the bounded command"
    grace = pod()["terminationGracePeriodSeconds"]
    # 30 s (GCP, Azure) to 2 min (AWS): a longer grace period is cut short by the node anyway.
    assert grace <= 120
    # The save, the drain until SIGKILL, then the promoter sidecar's own grace period.
    assert parsed.shutdown_timeout + drain + kill_after + config().promote.grace_period < grace


def test_disruptions_do_not_count_against_the_job() -> None:
    spec = job()["spec"]
    (rule,) = spec["podFailurePolicy"]["rules"]
    assert rule["action"] == "Ignore"
    assert rule["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    # Other failures count per index, and one index out of retries ends the Job.
    assert spec["backoffLimitPerIndex"] > 0 and spec["maxFailedIndexes"] == 0
    assert "backoffLimit" not in spec, "one budget shared by every index is what pre-emptions drained"
    assert pod()["restartPolicy"] == "Never", "podFailurePolicy and backoffLimitPerIndex need it"
    assert spec["podReplacementPolicy"] == "Failed", "never two pods of one index at once"


def test_the_entry_scripts_pass_shellcheck() -> None:
    for script in (BASE / "train.sh", DRILL / "drill.sh"):
        assert_shellcheck_clean(script)


def cronjob() -> Doc:
    (found,) = load(DRILL / "cronjob.yaml")
    return found


def drill_container() -> Doc:
    (found,) = cronjob()["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    return found


def test_the_restore_drill_uses_the_mounted_config_and_the_training_jobs_flags() -> None:
    drill = drill_container()
    assert drill["command"] == ["bash", f"{Path(config_mount(drill)).parent}/drill.sh"]
    variables = {e["name"]: str(e.get("value", "0")) for e in drill["env"]}
    script = (DRILL / "drill.sh").read_text()
    variables = shell.assignments(script, variables)
    defaulted = set(re.findall(r"\$\{(\w+):-", script))
    undefined = shell.variables(script) - set(variables) - defaulted - {"status"}
    assert not undefined, f"drill.sh uses {sorted(undefined)}, not set in the drill's env"
    (command,) = shell.invocations(shell.commands(script, variables), "tierstore")
    at, split = command.index("drill"), command.index("--")
    assert {a for a in command[at + 1 : split] if a.startswith("--")} == DRILL_FLAGS
    args = parse_tierstore(command)
    assert args.config == config_mount(drill)
    # The step function gets the training job's own flags: the same config and LR schedule.
    entry_args = command[split + 1 :]
    assert entry_args[entry_args.index("--config") + 1] == config_mount(drill)
    flags = [a for a in entry_args if a.startswith("--")]
    assert not set(flags) - trainer_flags(), f"train_gpt.py has no {flags}"
    trainer = {e["name"]: e.get("value") for e in container("trainer")["env"]}
    for flag, variable in (
        ("--steps", "STEPS"),
        ("--global-batch", "GLOBAL_BATCH"),
        ("--micro-batch", "MICRO_BATCH"),
    ):
        assert entry_args[entry_args.index(flag) + 1] == trainer[variable], flag
    (patch,) = load(RUN_DIR_VOLUME / "job-run-dir.yaml")
    (patched,) = patch["spec"]["template"]["spec"]["containers"]
    run_dir = {e["name"]: e["value"] for e in patched["env"]}["RUN_DIR"]
    assert Path(args.loss_log).parent == Path(run_dir), "the drill reads the run's own loss log"


def test_the_restore_drill_requests_resources_and_cannot_hang_forever() -> None:
    drill = drill_container()
    requests = drill["resources"]["requests"]
    assert {"cpu", "memory"} <= set(requests) and drill["resources"]["limits"]["memory"]
    spec = cronjob()["spec"]
    assert spec["concurrencyPolicy"] == "Forbid" and spec["jobTemplate"]["spec"]["activeDeadlineSeconds"]
    runs = [m for m in drill["volumeMounts"] if m["name"] == "runs"]
    assert runs and all(m.get("readOnly") for m in runs), "the drill only reads the run directory"


def test_the_run_directory_claim_is_explicit_and_names_its_class() -> None:
    # The base trainer mounts no claim: only the run-dir-volume component does, on purpose.
    assert not [v for v in pod()["volumes"] if "persistentVolumeClaim" in v]
    (claim,) = load(RUN_DIR_VOLUME / "runs-pvc.yaml")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"], "never the default class (often ReadWriteOnce only)"
    built = {d["kind"]: d for d in kustomize(OVERLAYS["full"])}
    assert built["PersistentVolumeClaim"]["spec"]["storageClassName"]


RUNS_CLASS_PATCH = """
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: tierstore-runs}
spec: {storageClassName: cephfs}
"""
NVME_CLASS_PATCH = """
apiVersion: batch/v1
kind: Job
metadata: {name: gpt-train}
spec:
  template:
    spec:
      volumes:
        - name: nvme
          ephemeral:
            volumeClaimTemplate:
              spec: {storageClassName: topolvm-nvme}
"""


@pytest.mark.parametrize(
    ("overlay", "patch", "kind", "expected"),
    [
        ("full", RUNS_CLASS_PATCH, "PersistentVolumeClaim", "cephfs"),
        ("restricted", NVME_CLASS_PATCH, "Job", "topolvm-nvme"),
    ],
)
def test_an_overlay_of_ones_own_sets_a_storage_class(
    tmp_path: Path, overlay: str, patch: str, kind: str, expected: str
) -> None:
    """The storage classes are parameters: an overlay of one's own over the shipped one sets them
    with a patch (docs/deployment.md shows both), and nothing else changes."""
    mine = {"resources": [os.path.relpath(OVERLAYS[overlay], tmp_path)], "patches": [{"patch": patch}]}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(mine))
    shipped, patched = kustomize(OVERLAYS[overlay]), kustomize(tmp_path)
    (doc,) = [d for d in patched if d["kind"] == kind]
    if kind == "Job":
        (nvme,) = [v for v in doc["spec"]["template"]["spec"]["volumes"] if v["name"] == "nvme"]
        found = nvme["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"]
    else:
        found = doc["spec"]["storageClassName"]
    assert found == expected
    assert len(patched) == len(shipped) and yaml.safe_dump(patched).replace(expected, "") == (
        yaml.safe_dump(shipped).replace("nfs-client" if kind != "Job" else "local-nvme", "")
    ), "the patch changed more than the class"


def test_drill_sh_pushes_the_drills_metrics_and_keeps_its_status(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "tierstore"
    fake.write_text(  # writes --prom-file as the drill does, and fails as a mismatching drill does
        '#!/bin/bash\nwhile [ "$1" != --prom-file ]; do shift; done\n'
        'echo "tierstore_drill_success{tier=\\"s3\\"} 0" >"$2"\nexit 1\n'
    )
    fake.chmod(0o755)
    pushed: list[tuple[str, str, bytes]] = []

    class Gateway(BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            pushed.append((self.command, self.path, body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "TMPDIR": str(tmp_path),
        "RUN_DIR": "/runs/gpt-demo",
        "STEPS": "10",
        "GLOBAL_BATCH": "8",
        "MICRO_BATCH": "8",
        "POD_NAMESPACE": "ml",
        "PUSHGATEWAY_URL": f"http://127.0.0.1:{server.server_port}/",
    }
    try:
        result = subprocess.run(
            ["bash", str(DRILL / "drill.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        quiet = subprocess.run(
            ["bash", str(DRILL / "drill.sh")],
            env={**env, "PUSHGATEWAY_URL": ""},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        server.shutdown()
    assert result.returncode == quiet.returncode == 1, "the Job fails when the drill fails"
    assert pushed == [
        ("PUT", "/metrics/job/tierstore_drill/namespace/ml", b'tierstore_drill_success{tier="s3"} 0\n')
    ]


def builtin(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] not in CRDS]


def raw_resources() -> list[Doc]:
    """Every resource file, read without kubectl (the generated ConfigMap aside)."""
    docs = base_docs() + load(BASE / "secret.example.yaml")
    for folder in (K8S / "components").iterdir():
        docs += [d for name in kustomization(folder)["resources"] for d in load(folder / name)]
    return docs


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_resource_file_validates_strictly(version: str) -> None:
    for doc in builtin(raw_resources()):
        validate(doc, version, strict=True)


def test_strict_validation_rejects_an_unknown_field() -> None:
    broken = job()
    broken["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    with pytest.raises(Exception, match="restartPolicyy"):
        validate(broken, K8S_VERSIONS[0], strict=True)


def kustomize(folder: Path) -> list[Doc]:
    kubectl = system_tool("kubectl", "kustomize builds")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_kustomize_builds_and_the_output_validates(name: str) -> None:
    docs = kustomize(OVERLAYS[name])
    kinds = sorted(d["kind"] for d in docs)
    assert {"ConfigMap", "Job", "Service"} <= set(kinds)
    for version in K8S_VERSIONS:
        for doc in builtin(docs):
            validate(doc, version, strict=True)
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert configmap["data"]["tierstore.yaml"] == (BASE / "tierstore.yaml").read_text()
    built_jobs = [d for d in docs if d["kind"] in ("Job", "CronJob")]
    for doc in built_jobs:  # kustomize rewrote every reference to the hashed ConfigMap name
        text = yaml.safe_dump(doc)
        assert configmap["metadata"]["name"] in text


def pod_templates(docs: list[Doc]) -> dict[str, Doc]:
    """Every pod spec in ``docs``, by the kind and name of what makes the pods."""
    found = {}
    for doc in docs:
        if doc["kind"] == "Job":
            found[f"Job/{doc['metadata']['name']}"] = doc["spec"]["template"]["spec"]
        elif doc["kind"] == "CronJob":
            template = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
            found[f"CronJob/{doc['metadata']['name']}"] = template
    return found


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_every_pod_meets_pod_security_restricted_but_for_the_nvme_hostpath(name: str) -> None:
    pods = pod_templates(kustomize(OVERLAYS[name]))
    assert pods
    for what, spec in pods.items():
        for level in (BASELINE, RESTRICTED):
            found = violations(spec, level)
            if not name.startswith("restricted") and what.startswith("Job/"):
                # hostPath: forbidden by both levels; the namespace needs "privileged".
                assert found and all(v.startswith("volume nvme:") for v in found), found
            else:
                assert found == [], f"{name} {what} is refused by {level}: {found}"


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_every_claim_a_pod_mounts_is_in_the_same_build(name: str) -> None:
    """A pod whose claim is missing stays Pending without an error anywhere: restore-drill needs
    run-dir-volume's claim, and every shipped overlay that has the one has the other."""
    docs = kustomize(OVERLAYS[name])
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for what, spec in pod_templates(docs).items():
        for volume in spec["volumes"]:
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, (name, what)


def test_the_pod_security_check_finds_each_rule_broken() -> None:
    spec = copy.deepcopy(pod_templates(kustomize(OVERLAYS["restricted"]))["Job/gpt-train"])
    assert violations(spec, RESTRICTED) == []
    spec["hostNetwork"] = True
    trainer = next(c for c in spec["containers"] if c["name"] == "trainer")
    context = trainer["securityContext"]
    context.update(
        privileged=True, allowPrivilegeEscalation=True, runAsUser=0, capabilities={"add": ["SYS_ADMIN"]}
    )
    promoter = spec["initContainers"][0]
    promoter["securityContext"]["seccompProfile"] = {"type": "Unconfined"}
    del spec["securityContext"]["runAsNonRoot"]
    promoter["securityContext"].update(
        procMount="Unmasked",
        appArmorProfile={"type": "Unconfined"},
        seLinuxOptions={"type": "spc_t"},
        windowsOptions={"hostProcess": True},
    )
    spec["securityContext"].update(runAsUser=0, sysctls=[{"name": "kernel.msgmax", "value": "1"}])
    found = "\n".join(violations(spec, RESTRICTED))
    for rule in (
        "spec.hostNetwork",
        "trainer: privileged",
        "trainer: adds capabilities ['SYS_ADMIN']",
        "trainer: allowPrivilegeEscalation",
        "trainer: runAsNonRoot",
        "trainer: runAsUser 0",
        "promoter: seccomp Unconfined",
        "trainer: capabilities do not drop ALL",
        "promoter: procMount Unmasked",
        "promoter: AppArmor Unconfined",
        "promoter: SELinux type spc_t",
        "promoter: windows hostProcess",
        "pod: unsafe sysctls ['kernel.msgmax']",
        "pod: runAsUser 0",
    ):
        assert rule in found, f"{rule!r} not found in:\n{found}"
    # Baseline forbids these as well; restricted adds the rest.
    baseline = "\n".join(violations(spec, BASELINE))
    assert "promoter: procMount Unmasked" in baseline and "trainer: runAsUser 0" not in baseline


def test_every_container_has_a_read_only_root_and_a_writable_tmp() -> None:
    for name, folder in OVERLAYS.items():
        for what, spec in pod_templates(kustomize(folder)).items():
            for c in spec.get("initContainers", []) + spec["containers"]:
                assert c["securityContext"]["readOnlyRootFilesystem"] is True, (name, what, c["name"])
                assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}, (what, c["name"])
                assert {"name": "HOME", "value": "/tmp"} in c["env"], (what, c["name"])


def test_the_restricted_overlay_puts_the_local_tier_on_an_ephemeral_nvme_volume() -> None:
    built = pod_templates(kustomize(OVERLAYS["restricted"]))["Job/gpt-train"]
    (nvme,) = [v for v in built["volumes"] if v["name"] == "nvme"]
    assert set(nvme) == {"name", "ephemeral"}
    claim = nvme["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] and claim["accessModes"] == ["ReadWriteOnce"]


def test_every_container_requests_cpu_and_memory() -> None:
    """Without requests the scheduler may pack a node until a save's copy crawls."""
    for name, folder in OVERLAYS.items():
        for what, spec in pod_templates(kustomize(folder)).items():
            for c in spec.get("initContainers", []) + spec["containers"]:
                requests = c.get("resources", {}).get("requests", {})
                assert {"cpu", "memory"} <= set(requests), (name, what, c["name"])


def test_an_overlay_combines_restricted_with_the_restore_drill() -> None:
    built = pod_templates(kustomize(OVERLAYS["restricted-full"]))
    assert "Job/gpt-train" in built and any(w.startswith("CronJob/") for w in built)
