"""The README's table: kvpress+QuantizedCache (scored with kvjax's metrics) beside kvjax.eval's rows, on the
samples both sides have (paired), with bytes per decode step (all 30 layers, K+V, 16-bit accounting).

    python eval/kvpress_quantized/table.py scored.jsonl kvjax_results.jsonl [KVJAX_POLICY]

KVJAX_POLICY: the kvjax preset paired with kvpress's KnormPress (default knorm_kvpress: every layer compressed,
as KnormPress; kvjax's `knorm` leaves layers 0 and 1 whole, as KVCache-Factory).
"""
import json
import sys

kvp = [json.loads(l) for l in open(sys.argv[1])]
kvj = [json.loads(l) for l in open(sys.argv[2])]
pol = sys.argv[3] if len(sys.argv) > 3 else "knorm_kvpress"
name = {"full": "none", pol: "knorm"}
jmap = {(r["sample_id"], name[r["policy"]], r["kv_quant"]): r for r in kvj if r["policy"] in name}
groups = {}
for r in kvp:
    k = (r["id"], r["press"], r["cache"])
    if k in jmap:
        groups.setdefault((r["press"], r["cache"]), []).append((r, jmap[k]))
print(f"kvjax policy paired with KnormPress: {pol}\n")
print("| press (r=0.5) | storage | n | kvpress+QuantizedCache score | kvjax score | kvpress: attention reads (dequantized, 16 bit) MB/step | kvpress: dequant+concat+attention reads MB/step | kvpress: stored MB | kvjax: cache read MB/step (kv_bytes16_mean) | kept entries/head kvpress / kvjax |")
print("|---|---|---|---|---|---|---|---|---|---|")
mb = lambda x: f"{x / 1e6:.2f}"
for (press, cache), rows in sorted(groups.items()):
    n = len(rows)
    sp = 100 * sum(a["score"] for a, _ in rows) / n
    sj = 100 * sum(b["score"] for _, b in rows) / n
    avg = lambda key: sum(a.get(key, 0) for a, _ in rows) / n
    bj = sum(b["stats"]["kv_bytes16_mean"] for _, b in rows) / n
    print(f"| {press} | {cache} | {n} | {sp:.1f} | {sj:.1f} | {mb(avg('attn_read16'))} | {mb(avg('total_read16'))} | "
          f"{mb(avg('stored16'))} | {mb(bj)} | {avg('attn_read16') / 23040:.0f} / {sum(b['stats']['kept_mean'] for _, b in rows) / n:.0f} |")
