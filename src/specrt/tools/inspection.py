"""What `specrt inspect` shows of a bundle: its limits, what each role runs at and how far
that is from float32, its profiles and its roles' shapes, and that every file was verified."""

from __future__ import annotations

from collections import Counter

from specrt.bundle import Bundle


def bundle_lines(bundle: Bundle) -> list[str]:
    """The summary of a bundle loaded with full_check (its files re-hashed)."""
    m = bundle.manifest
    lines: list[str] = []
    versions = ", ".join(f"{k} {v}" for k, v in sorted(m["versions"].items()))
    lines.append(f"bundle       {bundle.path}  (format {m['format_version']}, {m['created_utc']})")
    lines.append(f"built with   {versions}")
    lines.append(
        f"limits       max context {m['max_context']}   "
        f"K_max {m['max_draft']}   lookup window {bundle.max_lookup}   "
        f"eos ids {m['eos_token_ids']}"
    )
    lines += precision_lines(bundle)
    profiles = "   ".join(
        f"{name} {p['min_tokens']}..{p['max_tokens']}" for name, p in m["profiles"].items()
    )
    lines.append(f"profiles     {profiles} new tokens")
    lines.append(f"chat         {'template present' if m.get('chat_template') else 'no template'}")
    header = (
        f"{'role':7} {'arch':8} {'layers':>6} {'heads':>5} {'kv':>3} {'hdim':>5} "
        f"{'hidden':>6} {'vocab':>7}  {'max|dlogit|':>11}  source"
    )
    lines.append(header)
    files = 0
    for name in bundle.roles:
        info = m["roles"][name]
        s, check = info["shape"], info["export_check"]
        lines.append(
            f"{name:7} {s['architecture']:8} {s['num_layers']:>6} {s['num_heads']:>5} "
            f"{s['num_kv_heads']:>3} {s['head_dim']:>5} {s['hidden_size']:>6} "
            f"{s['vocab_size']:>7}  {check['max_abs_logit_diff']:>11.2e}  "
            f"{info['source']['spec']}"
        )
        files += len(info["files"])
    for name in bundle.roles:
        lines += _checked_part(name, m["roles"][name])
        lines += _gpu_graph(name, m["roles"][name])
    lines.append(f"files        {files} verified against their sha256")
    return lines


def _gpu_graph(name: str, info: dict) -> list[str]:
    """The role's GPU graph, where the bundle has one, and how far it is from the CPU's."""
    gpu = info.get("gpu")
    if gpu is None:
        return []
    checked = info["export_check"].get("gpu_graph_vs_float32", {})
    return [
        f"gpu graph    {name} {gpu['graph']}: {gpu['precision']}, {gpu['attention']} attention, "
        f"for {', '.join(gpu['backends'])}; max |dlogit| vs float32 "
        f"{checked.get('max_abs_logit_diff_vs_float32', float('nan')):.2e}"
    ]


def _checked_part(name: str, info: dict) -> list[str]:
    """Where the export check ran on a part of the model (bounded memory), which part."""
    check, shape = info["export_check"], info["shape"]
    layers = check.get("checked_layers")
    vocabulary = check.get("checked_vocabulary", shape["vocab_size"])
    if layers is None or (len(layers) == shape["num_layers"] and vocabulary == shape["vocab_size"]):
        return []
    return [
        f"{'checked':12} {name}: max|dlogit| on layers {layers} of {shape['num_layers']}, "
        f"{vocabulary} of {shape['vocab_size']} token ids (`specrt eval` scores the whole model)"
    ]


def precision_lines(bundle: Bundle) -> list[str]:
    """What each role runs at, how far that is from float32 (the build's check), and what it
    means for the outputs."""
    target = bundle.role("target").precision
    exact = "the float32 target" if target == "fp32" else f"the {target} target, not float32"
    if bundle.role("target").kv_cache != "float32" and target != "fp16":
        exact = f"the {target} target with its {bundle.role('target').kv_cache} cache"
    lines = []
    for name in bundle.roles:
        role = bundle.role(name)
        info = role.info.get("precision", {"weights": "fp32"})
        how = ""
        if "tensors" in info:
            kinds = Counter(form.split(" ")[0] for form in info["tensors"].values())
            blocks = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
            how = f" (the GGUF's own blocks: {blocks}; accuracy level {info['accuracy_level']}"
            how += f"; embedding {info.get('embedding', 'fp32')})"
        elif "block_size" in info:
            how = f" (MatMulNBits, block {info['block_size']}, accuracy level "
            how += f"{info['accuracy_level']}; embedding {info['embedding']})"
        if role.kv_cache != "float32" and role.precision != "fp16":
            how += f"; keys and values kept in {role.kv_cache}"
        check = role.info["export_check"]
        if "kl_mean_vs_float32" in check:
            how += (
                f"; vs float32 on {check['sample_tokens']} tokens of prose: KL "
                f"{check['kl_mean_vs_float32']:.4f}, top-1 {check['top1_agreement_vs_float32']:.1%}"
            )
        elif "argmax_agreement_vs_float32" in check:  # bundles built before the prose check
            how += (
                f"; vs float32: max |dlogit| {check['max_abs_logit_diff_vs_float32']:.2e}, "
                f"argmax agreement {check['argmax_agreement_vs_float32']:.0%} on random tokens"
            )
        label = "precision" if name == bundle.roles[0] else ""
        lines.append(f"{label:12} {name} {role.precision}{how}")
    lines.append(
        f"{'':12} outputs are exact against {exact}; the draft's precision only moves acceptance"
        if bundle.has_draft
        else f"{'':12} no draft model: lookup (n-gram) drafts; outputs exact against {exact}"
    )
    return lines
