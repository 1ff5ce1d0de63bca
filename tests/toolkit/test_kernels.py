"""``numba-kv kernels``: the resource table of the CUDA kernels (no GPU)."""

import json

import pytest

from numba_kv.toolkit import kernels
from numba_kv.toolkit.cli import main


def test_parse_cc():
    assert kernels.parse_cc("9.0, 8.0,8.6") == [(9, 0), (8, 0), (8, 6)]
    assert kernels.parse_cc("9") == [(9, 0)]
    with pytest.raises(ValueError, match=r"--cc: limits are known for 8.0, 8.6, 8.9, 9.0, got '7.5'"):
        kernels.parse_cc("9.0,7.5")
    with pytest.raises(ValueError, match="--cc: expected compute capabilities like 9.0,8.0"):
        kernels.parse_cc("hopper")


def test_report_rejects_bad_arguments():
    with pytest.raises(ValueError, match="--kernel: no registered kernel 'nope'"):
        kernels.report([(9, 0)], 128, ["nope"])
    with pytest.raises(ValueError, match="--threads: expected 1 to 1024 threads per block, got 2048"):
        kernels.report([(9, 0)], 2048, ["pack_bits"])


def test_markdown_row():
    row = {"kernel": "k", "cc": "9.0", "registers": 126, "spill_stores": 0, "spill_loads": 4, "local": 8,
           "shared": 47104, "max_block_threads": 512, "threads": 128, "blocks_per_sm": 4, "warps_per_sm": 16,
           "occupancy": 0.25, "limiters": ["registers", "shared"]}
    table = kernels.to_markdown([row, row | {"blocks_per_sm": 0, "limiters": []}]).splitlines()
    assert table[0].startswith("| kernel | sm | registers |") and len(table) == 4
    assert table[2] == "| `k` | 9.0 | 126 | 0/4 | 8 | 47104 | 512 | 4 | 16 | 25 % | registers, shared |"
    assert table[3].endswith("| does not launch |")


@pytest.mark.ptx
def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "k.json"
    assert main(["kernels", "--cc", "9.0,8.0", "--kernel", "merge_partitions", "--threads", "64",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "occupancy at 64 threads per block" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["cc"], r["threads"]) for r in rows] == [("merge_partitions", "9.0", 64),
                                                                     ("merge_partitions", "8.0", 64)]
    for r in rows:
        # the merge kernel keeps its weights in shared memory, never spills, and launches at 64 threads
        assert r["shared"] > 0 and (r["spill_stores"], r["spill_loads"], r["local"]) == (0, 0, 0)
        assert r["blocks_per_sm"] >= 1 and r["warps_per_sm"] == 2 * r["blocks_per_sm"]
        assert f"| `merge_partitions` | {r['cc']} | {r['registers']} |" in text


def test_cli_errors_exit_2(capsys):
    assert main(["kernels", "--cc", "7.5"]) == 2
    assert "numba-kv kernels: error: --cc: limits are known for" in capsys.readouterr().err
    assert main(["kernels", "--kernel", "nope"]) == 2
    assert "--kernel: no registered kernel 'nope'" in capsys.readouterr().err
