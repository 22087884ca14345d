"""The report shows the cache each setting really used, and marks settings whose cache never came
down to their budget (lazy_eviction answering before its first eviction)."""

import json

from kvjax.eval.report import SCORE_NOTE, UNREACHED_MARK, plot_points, write_reports
from kvjax.eval.runner import make_settings

T = 880.0  # prompt entries per KV head
ENTRY = 4096  # key + value bytes per entry, all layers and heads


def _row(st, i, score, kept_mean, kept_peak, budget, reached):
    stats = {"kept": kept_mean - 5, "kept_mean": kept_mean, "kept_peak": kept_peak,
             "kv_bytes_mean": int(kept_mean * ENTRY), "kv_bytes_peak": int(kept_peak * ENTRY),
             "budget": budget, "budget_reached": reached}
    return {"task": "vt", "policy": st.policy_name, "setting": st.label, "compression_ratio": st.compression_ratio,
            "budget": st.budget, "sample_id": f"vt/{i}", "prediction": "x", "score": score, "metrics": {},
            "stats": stats}


def test_cache_columns_and_the_unreached_budget_mark(tmp_path, capsys):
    full, lazy, snap = make_settings(["lazy_eviction", "snapkv"], [0.75])
    rows = [_row(full, i, 1.0, T + 5, T + 10, None, None) for i in range(2)]
    rows += [_row(lazy, i, 1.0, T + 5, T + 10, 220, False) for i in range(2)]  # never evicted
    rows += [_row(snap, 0, 0.0, 230.0, 235.0, 220, True), _row(snap, 1, 0.5, 232.0, 240.0, 220, True)]
    result = write_reports(tmp_path, rows, ["vt"], [full, lazy, snap], echo=True)
    printed = capsys.readouterr().out
    table = printed.split("\n\n")[0] if "\n\n" in printed else printed
    assert table.splitlines()[0].split()[-6:] == ["kept", "mean", "kept", "peak", "KV", "MiB"]
    lines = {ln.split()[0] + " " + ln.split()[1]: ln.split() for ln in table.splitlines()[2:] if ln.strip()
             and not ln.startswith(("score", "kept", UNREACHED_MARK, "-"))}
    # the scores are unchanged; the cache columns are the means (and the peak) over the samples
    assert lines[f"lazy_eviction r=0.75{UNREACHED_MARK}"][2:4] == ["100.00", "100.00"]
    assert lines["snapkv r=0.75"][2:] == ["25.00", "25.00", "231.00", "240.00", f"{231 * ENTRY / 2**20:.3g}"]
    assert lines["full full"][4:6] == ["885.00", "890.00"]
    note = next(ln for ln in printed.splitlines() if ln.startswith(f"{UNREACHED_MARK} lazy_eviction r=0.75"))
    assert "in 2 of 2 samples" in note and "~220 entries" in note and "885" in note
    assert not any(ln.startswith(f"{UNREACHED_MARK} snapkv") for ln in printed.splitlines())
    md = (tmp_path / "results.md").read_text()
    assert f"| lazy_eviction | r=0.75{UNREACHED_MARK} | 100.00 | 100.00 | 885.00 | 890.00 |" in md
    assert note in md and all(line in md for line in SCORE_NOTE)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    cache = {(c["policy"], c["setting"]): c for c in metrics["cache"]}
    assert cache[("lazy_eviction", "r=0.75")]["unreached"] == 2 and cache[("snapkv", "r=0.75")]["unreached"] == 0
    assert metrics["table"]["rows"][1] == ["lazy_eviction", "r=0.75", 100.0, 100.0]  # the scores table as before
    # the plot draws each setting at the cache it really held, and the unreached one hollow
    points = plot_points(result["summary"], ["vt"], [full, lazy, snap], {k: v for k, v in cache.items()})
    assert points["lazy_eviction"] == [{"x": 0.75, "score": 100.0, "kept": T + 5, "unreached": True}]
    assert points["snapkv"] == [{"x": 0.75, "score": 25.0, "kept": 231.0, "unreached": False}]
    assert (tmp_path / "score_vs_compression.png").read_bytes()[:4] == b"\x89PNG"
