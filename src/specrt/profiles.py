"""Shape profiles: the three ways the runtime calls a model, as ranges of token counts.

A speculative loop calls its models in three shapes: a *prefill* of the prompt, a *decode* of
exactly one token (the draft's hot path) and a *verify* of K+1 tokens (the target's hot path),
each on top of a cache holding 0 .. max_context - new tokens. Engines that compile for shapes
(TensorRT, ONNX Runtime's TensorRT provider) get one optimization profile per call shape, so each
is tuned for its own typical case instead of one profile stretched across all three.

The plan is computed once at build time and recorded in the manifest; engines read it back and
pick a profile by the number of new tokens. The cache buffers themselves have a fixed shape
(`[1, max_context, kv_heads, head_dim]`, updated in place: see `cache_dims`), so what varies per
call is the new tokens (`input_ids`, `position_ids`) and the total length (`attention_mask`),
plus the value of `logits_to_keep`, which sets an output shape and is therefore a shape input
for TensorRT.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specrt.errors import SpecrtError

OPT_PROMPT = 64  # typical prompt length the opt shapes are tuned for
OPT_DRAFT = 4  # typical K


@dataclass(frozen=True)
class Profile:
    """One call shape: new tokens min/opt/max, and total (past + new) tokens min/opt/max."""

    name: str
    min_tokens: int
    opt_tokens: int
    max_tokens: int
    min_total: int
    opt_total: int
    max_total: int
    opt_keep: int  # logits rows at the opt point: 1 for a prefill, every row when verifying

    def as_dict(self) -> dict:
        record = asdict(self)
        del record["name"]
        return record

    def fits(self, new_tokens: int, total: int) -> bool:
        return (
            self.min_tokens <= new_tokens <= self.max_tokens
            and self.min_total <= total <= self.max_total
        )


def plan_profiles(
    max_context: int, max_window: int, *, opt_prompt: int = OPT_PROMPT, opt_draft: int = OPT_DRAFT
) -> list[Profile]:
    """prefill, decode and verify for a bundle's limits (max_window: the most drafts a verify
    call carries, K_max or the longer lookup window); opt shapes from the typical case (a short
    prompt, K around 4, a context of about twice the prompt)."""
    if max_window < 1 or max_context < max_window + 2:
        raise SpecrtError(f"max context {max_context} leaves no room for {max_window} drafts")
    max_prompt = max_context - max_window - 1
    prompt = min(opt_prompt, max_prompt)
    context = min(2 * prompt, max_context)
    verify = min(opt_draft, max_window) + 1
    return [
        Profile("prefill", 1, prompt, max_prompt, 1, prompt, max_context, 1),
        Profile("decode", 1, 1, 1, 1, context, max_context, 1),
        Profile("verify", 2, verify, max_window + 1, 2, context, max_context, verify),
    ]


def profiles_from_manifest(manifest: dict) -> list[Profile]:
    """The recorded plan, in the order the engines were built with (index = profile index)."""
    recorded = manifest.get("profiles", {})
    try:
        return [Profile(name, **recorded[name]) for name in ("prefill", "decode", "verify")]
    except (KeyError, TypeError) as err:
        raise SpecrtError(
            "the bundle's manifest has no complete shape profiles (built by an older specrt); "
            "rebuild it to use a shape-compiled backend"
        ) from err


def select_profile(profiles: list[Profile], new_tokens: int, total: int) -> int:
    """Index of the profile made for this call: decode for one token, verify for 2 up to the
    longest window + 1, prefill for anything longer (each profile's ranges decide what fits)."""
    index = {p.name: i for i, p in enumerate(profiles)}
    for name in ("decode", "verify", "prefill"):
        if name in index and profiles[index[name]].fits(new_tokens, total):
            return index[name]
    raise SpecrtError(
        f"a call with {new_tokens} new tokens and {total} in total fits none of the bundle's "
        "profiles (" + ", ".join(f"{p.name} {p.min_tokens}..{p.max_tokens}" for p in profiles) + ")"
    )


def input_shapes(
    profile: Profile,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    capacity: int,
    batch: int = 1,
    margin: int = 0,
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """min/opt/max shape of every graph input under `profile`, for calls of 1..batch rows (opt:
    one) on caches of capacity + margin positions (the margin lets a padded batched call write
    past the longest row's context, so its total reaches margin further)."""

    def rows(low: int, opt: int, high: int, top: int = 0):
        return (1, low), (1, opt), (batch, high + top)

    cache = cache_dims(batch, capacity + margin, num_kv_heads, head_dim)
    tokens = rows(profile.min_tokens, profile.opt_tokens, profile.max_tokens)
    shapes = {
        "input_ids": tokens,
        "position_ids": tokens,
        "attention_mask": rows(profile.min_total, profile.opt_total, profile.max_total, margin),
        "logits_to_keep": ((1,),) * 3,
    }
    for i in range(num_layers):
        for kind in ("key", "value"):
            shapes[f"past_key_values.{i}.{kind}"] = ((1, *cache[1:]), (1, *cache[1:]), cache)
    return shapes


def cache_dims(
    batch: int, positions: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    """A cache buffer's dims: laid out by position (exporter/attention.py). A compiled engine
    binds the whole buffer."""
    return (batch, positions, num_kv_heads, head_dim)


def keep_values(profile: Profile) -> tuple[tuple[int], tuple[int], tuple[int]]:
    """min/opt/max *value* of the `logits_to_keep` shape input under `profile`: a prefill and a
    decode keep the last row (the runtime asks no more of them), a verify call every row."""
    most = profile.max_tokens if profile.name == "verify" else 1
    return (1,), (min(profile.opt_keep, most),), (most,)


def kept_rows(profiles: list[Profile]) -> int:
    """The most logits rows one call of batch 1 returns: what an engine's logits buffer holds
    (a verify window, not a prompt: at a 151,936-token vocabulary, 2,048 rows would be 1.2 GB)."""
    return max(keep_values(p)[2][0] for p in profiles)
