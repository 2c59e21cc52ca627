"""Memory stays flat over many saves: anonymous RSS does not grow, and the memory tier holds only
``keep`` checkpoints plus the documented staging slabs (measured apart: slab pages are shared memory).

Forty consecutive ``async_save`` calls from one writer in a fresh process, retention applied after
each as the promoter would; both modes (default and overlapped).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

SAVES = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed.checkpoint as dcp
    from tierstore import TieredWriter, load_config
    from tierstore.promote.retention import delete_copy

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    def tier_bytes(root):
        return sum(os.lstat(os.path.join(d, f)).st_blocks * 512
                   for d, _, files in os.walk(root) for f in files)

    config = load_config(sys.argv[1])
    overlap = sys.argv[2] == "overlap"
    keep, root = 2, config.tiers[0].path
    ram = config.make_tier("ram", node=0)
    writer = TieredWriter(config, overlap=overlap)
    state = {f"w{i}": torch.randn(2**20) for i in range(16)}  # 64 MiB
    anon, tier = [], []
    for step in range(40):
        for tensor in state.values():
            tensor.add_(1.0)  # training moves on between saves
        result = dcp.async_save(state, storage_writer=writer, checkpoint_id=f"step_{step:03d}")
        (result.upload_completion if overlap else result).result()
        if step >= keep:
            delete_copy(ram, f"step_{step - keep:03d}", trust=config.marker_trust())
        anon.append(status("RssAnon"))
        tier.append(tier_bytes(root))
    print(json.dumps({"anon": anon, "tier": tier, "shmem": status("RssShmem"),
                      "state": sum(t.nbytes for t in state.values())}))
""")


@pytest.mark.parametrize("mode", ["default", "overlap"])
def test_forty_saves_keep_anonymous_memory_and_the_tier_flat(mode: str, tmp_path: Path) -> None:
    memory = Path("/dev/shm") / f"tierstore-flat-{tmp_path.name}"
    config = tmp_path / "tierstore.yaml"
    config.write_text(yaml.safe_dump({"tiers": [{"name": "ram", "type": "memory", "path": str(memory)}]}))
    try:
        done = subprocess.run(
            [sys.executable, "-c", SAVES, str(config), mode],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        subprocess.run(["rm", "-rf", str(memory)], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    anon, tier, state = found["anon"], found["tier"], found["state"]

    growth = max(anon[5:]) - anon[5]  # after warm-up: imports, first allocations, thread pools
    assert growth < 32 * 2**20, f"anonymous RSS grew by {growth / 2**20:.1f} MiB over 35 saves"
    # After retention: `keep` checkpoints (the newest's data file is the slab it was staged in) and
    # the spare slab the next save copies into.
    bound = (2 + 1) * state + 8 * 2**20
    assert max(tier[5:]) <= bound, f"memory tier held {max(tier) / 2**20:.0f} MiB, bound {bound}"
    print(
        f"{mode}: anon growth {growth / 2**20:.1f} MiB, tier max {max(tier) / 2**20:.0f} MiB,"
        f" shmem {found['shmem'] / 2**20:.0f} MiB"
    )
