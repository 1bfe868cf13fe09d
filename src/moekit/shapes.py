"""MoE layer shapes and the presets of the models the seeds measure.

Every number here is the model's published configuration as the seeds quote it:

* mixtral-8x7b, qwen2-moe (57B-A14B), deepseek-v3: the MoE tax paper, Table 2;
* olmoe-1b-7b, qwen3-30b-a3b: the RaMP paper, Table IV, which lists E, the fused
  up-projection width 2N and the hidden size H (their top-k is 8, RaMP section III-A);
* dit-moe-xl, dit-moe-g: the DICE paper names these models but prints no dimensions;
  they come from the public DiT-MoE release the seed uses (XL/2-8E2A: 28 blocks, hidden
  1152; G/2-16E2A: 40 blocks, hidden 1408; experts of width 4*hidden, two shared experts
  of width hidden each).

``tests/test_shapes.py`` checks each preset against those tables.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MoEShape:
    """The dimensions of one MoE FFN block (and how many of them a model has).

    ``intermediate`` is the width N of one routed expert: it maps H -> 2N (gate and up,
    SwiGLU) -> N -> H. Shared experts run on every token, each of width
    ``shared_intermediate``.
    """

    name: str
    num_experts: int  # E, routed experts
    top_k: int  # K
    hidden: int  # H
    intermediate: int  # N, per routed expert
    num_shared_experts: int = 0
    shared_intermediate: int = 0  # N of one shared expert
    num_layers: int = 1

    def __post_init__(self) -> None:
        for field in ("num_experts", "top_k", "hidden", "intermediate", "num_layers"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEShape.{field} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEShape.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        if self.num_shared_experts < 0 or self.shared_intermediate < 0:
            raise ValueError("MoEShape shared-expert fields must be >= 0")
        if self.num_shared_experts > 0 and self.shared_intermediate == 0:
            raise ValueError("MoEShape.shared_intermediate must be > 0 when there are shared experts")

    def experts_per_rank(self, world_size: int) -> int:
        """E_local = E / P; raises when P does not divide E."""
        if world_size < 1 or self.num_experts % world_size != 0:
            raise ValueError(
                f"world_size must divide num_experts={self.num_experts}, got {world_size}"
            )
        return self.num_experts // world_size

    def scaled(self, **changes) -> "MoEShape":
        """A copy with some fields changed (e.g. a scaled-down shape for CPU runs)."""
        return replace(self, **changes)


PRESETS: dict[str, MoEShape] = {
    s.name: s
    for s in (
        MoEShape("mixtral-8x7b", num_experts=8, top_k=2, hidden=4096, intermediate=14336, num_layers=32),
        MoEShape(
            "qwen2-moe", num_experts=64, top_k=8, hidden=3584, intermediate=2560,
            num_shared_experts=8, shared_intermediate=2560, num_layers=28,
        ),
        MoEShape(
            "deepseek-v3", num_experts=256, top_k=8, hidden=7168, intermediate=2048,
            num_shared_experts=1, shared_intermediate=2048, num_layers=61,
        ),
        MoEShape("olmoe-1b-7b", num_experts=64, top_k=8, hidden=2048, intermediate=1024, num_layers=16),
        MoEShape("qwen3-30b-a3b", num_experts=128, top_k=8, hidden=2048, intermediate=768, num_layers=48),
        MoEShape(
            "dit-moe-xl", num_experts=8, top_k=2, hidden=1152, intermediate=4608,
            num_shared_experts=2, shared_intermediate=1152, num_layers=28,
        ),
        MoEShape(
            "dit-moe-g", num_experts=16, top_k=2, hidden=1408, intermediate=5632,
            num_shared_experts=2, shared_intermediate=1408, num_layers=40,
        ),
    )
}


def get_shape(name: str) -> MoEShape:
    """The preset called ``name``; a ValueError lists the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(sorted(PRESETS))}") from None
