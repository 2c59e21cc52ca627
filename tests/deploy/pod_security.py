"""The Kubernetes Pod Security Standards ("baseline" and "restricted", as of Kubernetes 1.33), checked
on a pod spec the way the admission controller checks it: :func:`violations` names each rule a pod
breaks. https://kubernetes.io/docs/concepts/security/pod-security-standards/

Every rule of both levels that a pod spec can break is here; the deprecated AppArmor annotations
(pod metadata, not spec) are not, and nothing in deploy/ sets them."""

from __future__ import annotations

from typing import Any

BASELINE, RESTRICTED = "baseline", "restricted"
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
SECCOMP_ALLOWED = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_ALLOWED = frozenset({"RuntimeDefault", "Localhost"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
"""Baseline's allowed sysctls as of Kubernetes 1.29 (policy version 1.29 and later)."""

Spec = dict[str, Any]


def _containers(pod: Spec) -> list[Spec]:
    return [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]


def _context_rules(context: Spec, who: str) -> list[str]:
    """Baseline's rules that apply alike to the pod's and each container's security context."""
    found = []
    if context.get("windowsOptions", {}).get("hostProcess"):
        found.append(f"{who}: windows hostProcess")
    apparmor = context.get("appArmorProfile", {}).get("type")
    if apparmor is not None and apparmor not in APPARMOR_ALLOWED:
        found.append(f"{who}: AppArmor {apparmor}")
    selinux = context.get("seLinuxOptions", {})
    if selinux.get("type", "") not in SELINUX_TYPES:
        found.append(f"{who}: SELinux type {selinux['type']}")
    if selinux.get("user") or selinux.get("role"):
        found.append(f"{who}: SELinux user or role set")
    return found


def _baseline(pod: Spec) -> list[str]:
    found = [f"spec.{key}" for key in ("hostNetwork", "hostPID", "hostIPC") if pod.get(key)]
    found += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    pod_context = pod.get("securityContext", {})
    found += _context_rules(pod_context, "pod")
    unsafe = {s["name"] for s in pod_context.get("sysctls", [])} - SAFE_SYSCTLS
    if unsafe:
        found.append(f"pod: unsafe sysctls {sorted(unsafe)}")
    for c in _containers(pod):
        context = c.get("securityContext", {})
        found += _context_rules(context, f"container {c['name']}")
        if context.get("procMount", "Default") != "Default":
            found.append(f"container {c['name']}: procMount {context['procMount']}")
        if context.get("privileged"):
            found.append(f"container {c['name']}: privileged")
        added = set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
        if added:
            found.append(f"container {c['name']}: adds capabilities {sorted(added)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"container {c['name']}: hostPort")
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"container {c['name']}: seccomp Unconfined")
    if pod.get("securityContext", {}).get("seccompProfile", {}).get("type") == "Unconfined":
        found.append("pod: seccomp Unconfined")
    return found


def _restricted(pod: Spec) -> list[str]:
    found = []
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_context = pod.get("securityContext", {})
    pod_seccomp = pod_context.get("seccompProfile", {}).get("type")
    if pod_context.get("runAsUser") == 0:  # forbidden at the pod level even if containers override
        found.append("pod: runAsUser 0")
    for c in _containers(pod):
        context, name = c.get("securityContext", {}), c["name"]
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"container {name}: allowPrivilegeEscalation not false")
        if not context.get("runAsNonRoot", pod_context.get("runAsNonRoot")):
            found.append(f"container {name}: runAsNonRoot not true")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            found.append(f"container {name}: runAsUser 0")
        if context.get("seccompProfile", {}).get("type", pod_seccomp) not in SECCOMP_ALLOWED:
            found.append(f"container {name}: no RuntimeDefault or Localhost seccomp profile")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"container {name}: capabilities do not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"container {name}: adds capabilities beyond NET_BIND_SERVICE")
    return found


def violations(pod: Spec, level: str) -> list[str]:
    """What in ``pod`` (a pod spec) the Pod Security ``level`` forbids; empty when it is admitted."""
    return _baseline(pod) + (_restricted(pod) if level == RESTRICTED else [])
