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


# --- numba-kv kernels --sass ----------------------------------------------------------------
def _sass_row(**kw):
    classes = dict.fromkeys(kernels.CLASS_COLUMNS, 0) | {"fp32": 64, "int": 192, "load.shared": 32}
    loop = {"header": "0x1a0", "depth": 0, "instructions": 288, "classes": classes}
    row = {"kernel": "k", "cc": "9.0", "error": None, "registers": 96, "spill_stores": 0, "spill_loads": 0,
           "loop": loop, "tokens_per_iteration": 32.0, "per_token": 9.0,
           "per_token_classes": {c: n / 32 for c, n in classes.items()},
           "nested": [{"header": "0x200", "depth": 1, "instructions": 40, "classes": classes | {"fp32": 8}}]}
    return row | kw


def test_sass_kernels_are_the_decode_attention_twins():
    names = kernels.sass_kernels()
    assert {"decode_attention", "decode_attention_warp"} <= set(names)
    assert all(n.startswith("decode_attention") for n in names)


def test_sass_markdown():
    rows = [_sass_row(), _sass_row(kernel="new", tokens_per_iteration=None, per_token=None, per_token_classes=None),
            _sass_row(kernel="broken", error="TypingError: no | match", loop=None, nested=[])]
    text = kernels.sass_markdown(rows).splitlines()
    assert text[2] == "| `k` | 9.0 | 96 | 0/0 | 0x1a0 (depth 0) | 288 | 32 | 9 |"
    assert text[3] == "| `new` | 9.0 | 96 | 0/0 | 0x1a0 (depth 0) | 288 | not stated | raw: see SASS / iteration |"
    assert text[4] == "| `broken` | 9.0 | does not compile: TypingError: no / match |"
    # the classes per token (32 tokens an iteration), or per iteration when not stated
    assert text[8].startswith("| `k` | 9.0 | token | 0 | 1 | 0 |") and "| 2 |" in text[8]
    assert text[9].startswith("| `new` | 9.0 | iteration | 0 | 32 | 0 |")
    assert "| `k` | 9.0 | 0x200 | 1 | 40 | int 192, ld.shared 32, fp32 8 |" in text


def test_cli_sass_errors(monkeypatch, capsys):
    def missing(name, cc):
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or 'numba-kv[cuda]')")

    monkeypatch.setattr(kernels, "kernel_sass", missing)
    assert main(["kernels", "--sass", "--kernel", "decode_attention"]) == 2
    assert capsys.readouterr().err == ("numba-kv kernels: error: nvdisasm not found: pip install "
                                       "nvidia-cuda-nvdisasm (or 'numba-kv[cuda]')\n")
    assert main(["kernels", "--sass", "--kernel", "nope"]) == 2
    assert "--kernel: no registered kernel 'nope'" in capsys.readouterr().err


def test_cli_sass_reports_a_kernel_that_does_not_compile(monkeypatch, capsys):
    def broken(name, cc):
        raise TypeError("No implementation of function\n  for signature ...")

    monkeypatch.setattr(kernels, "kernel_sass", broken)
    assert main(["kernels", "--sass", "--kernel", "decode_attention"]) == 1
    assert "| `decode_attention` | 9.0 | does not compile: TypeError: No implementation of function |" in (
        capsys.readouterr().out)


@pytest.mark.ptx
def test_cli_sass_prints_the_tables_and_writes_json(tmp_path, capsys):
    from numba_kv._sass import nvdisasm_path

    try:
        nvdisasm_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "s.json"
    assert main(["kernels", "--sass", "--kernel", "decode_attention_warp", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    [row] = json.loads(out.read_text())["rows"]
    assert (row["kernel"], row["cc"], row["error"], row["tokens_per_iteration"]) == ("decode_attention_warp", "9.0",
                                                                                     None, 32.0)
    assert row["per_token"] == round(row["loop"]["instructions"] / 32, 2)
    assert sum(row["loop"]["classes"].values()) == row["loop"]["instructions"]
    assert row["nested"] and all(n["depth"] >= 1 for n in row["nested"])
    assert f"| `decode_attention_warp` | 9.0 | {row['registers']} | 0/0 | {row['loop']['header']} (depth 0) |" in text
