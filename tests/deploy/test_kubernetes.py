"""deploy/kubernetes: the manifests agree with tierstore's CLI, its config and the trainer, build
with kustomize, and validate against the Kubernetes schemas (strict: unknown fields rejected)."""

from __future__ import annotations

import subprocess
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
from tests.deploy.tools import DEPLOY, pip_tool, system_tool

K8S = DEPLOY / "kubernetes"
BASE = K8S / "base"
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
    (found,) = [
        c for c in pod().get("initContainers", []) + pod()["containers"] if c["name"] == name
    ]
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
    assert "hostPath" in volume("nvme")


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
    # The final save drains inside the grace period: the save, then the sidecar's own grace.
    grace = pod()["terminationGracePeriodSeconds"]
    assert parsed.shutdown_timeout + config().promote.grace_period < grace
    assert "SIGTERM" in parsed.signals_to_handle.split(",")
    (drain,) = shell.invocations(argvs, "tierstore")
    args = parse_tierstore(drain)
    assert args.command == "promote" and args.once
    assert args.config == config_mount(container("trainer"))


def test_train_sh_passes_shellcheck() -> None:
    result = subprocess.run(
        [pip_tool("shellcheck"), "--shell=bash", str(BASE / "train.sh")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout == "", result.stdout


def test_the_restore_drill_cronjob_uses_the_mounted_config_and_the_drill_flags() -> None:
    folder = K8S / "components" / "restore-drill"
    (cronjob,) = load(folder / "cronjob.yaml")
    (drill,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    command = drill["command"]
    assert command[0] == "tierstore"
    assert command[command.index("--config") + 1] == config_mount(drill)
    at, split = command.index("drill"), command.index("--")
    assert {a for a in command[at + 1 : split] if a.startswith("--")} == DRILL_FLAGS
    parse_tierstore(command[1:])
    # The step function gets the training job's own flags: the same config and LR schedule.
    entry_args = command[split + 1 :]
    assert entry_args[entry_args.index("--config") + 1] == config_mount(drill)
    flags = [a for a in entry_args if a.startswith("--")]
    assert not set(flags) - trainer_flags(), f"train_gpt.py has no {flags}"
    (job,) = [d for d in base_docs() if d["kind"] == "Job"]
    trainer_env = {e["name"]: e.get("value") for c in job["spec"]["template"]["spec"]["containers"]
                   for e in c.get("env", [])}  # fmt: skip
    for flag, variable in (("--steps", "STEPS"), ("--global-batch", "GLOBAL_BATCH"),
                           ("--micro-batch", "MICRO_BATCH")):  # fmt: skip
        assert entry_args[entry_args.index(flag) + 1] == trainer_env[variable], flag
    (patch,) = load(folder / "job-run-dir.yaml")
    (trainer,) = patch["spec"]["template"]["spec"]["containers"]
    run_dir = {e["name"]: e["value"] for e in trainer["env"]}["RUN_DIR"]
    loss_log = command[command.index("--loss-log") + 1]
    assert Path(loss_log).parent == Path(run_dir), "the drill reads the run's own loss log"


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
    result = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize("folder", [BASE, K8S / "overlays" / "full"], ids=["base", "full"])
def test_kustomize_builds_and_the_output_validates(folder: Path) -> None:
    docs = kustomize(folder)
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
