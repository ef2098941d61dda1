"""How much of an int4 model's CPU step is transformers' and ours around the products: the eager backend and the graph
backend (its static cache on a CPU, since session 32) beside a lean forward of the same int4 weights, one process,
switched in turn.

    python benchmarks/cpu/lean_step.py --pair qwen-coder --roles target,draft --tokens 1,2,4

Session 31 measured the lean forward to decide whether to build the graph backend's CPU path; session 32 built it and
added its column (docs/quantization.md, "The graph backend on a CPU"). The lean forward is this file's own
few lines for Qwen2/Llama layers: q/k/v as one int4 product and gate/up as one (PyTorch's CPU int4 kernel, the
packing `spec.models.quant.pack` makes; grouped per output row, so the fused matrices hold the same codes and scales
as the separate layers), a static K/V cache, the rotary tables made once, and spec/models/attention.py's
arithmetic for the attention. The eager backend runs the same weights through transformers' modules: seven int4
products a layer, its DynamicCache, its masks. Both start from the same bf16 model; the lean one's logits are
checked against the eager one's on the cached text (`argmax_agreement`, `max_abs_diff`) and on each timed forward
(`forward_max_abs_diff`). Forwards of each token
count on 100 cached tokens, rounds of both in turn. Rows go to results/lean_step-<time>.jsonl as they come.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spec.harness import forward_times  # noqa: E402
from spec.io import Results, table  # noqa: E402
from spec.models.eager import EagerModel  # noqa: E402
from spec.models.pairs import PAIRS, load_model, make_model, resolve_pair  # noqa: E402
from spec.models.quant import GROUP, int4_library_mm, pack, quantize_model  # noqa: E402

COLUMNS = [("role", ""), ("tokens", ""), ("eager_ms", ".2f"), ("graph_ms", ".2f"), ("lean_ms", ".2f"),
           ("eager_over_graph", ".2f"), ("eager_over_lean", ".2f"), ("products_eager", ""), ("products_lean", "")]


class Int4:
    """One int4 product: [n, K] -> [n, rows] through PyTorch's CPU kernel."""

    def __init__(self, weight: torch.Tensor):
        self.rows = weight.shape[0]
        self.codes, self.scales = pack(weight.detach(), "int4")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return int4_library_mm(x, self.codes, GROUP, self.scales)[:, : self.rows]


class Lean:
    """A Qwen2/Llama model's forward over int4 weights and a static cache: forward / rollback / reset, as
    `spec.harness.forward_times` calls them."""

    def __init__(self, model, capacity: int = 1024):
        self.model, self.device = model, torch.device("cpu")
        config = model.config
        attn = model.model.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        self.intermediate, self.scaling = config.intermediate_size, attn.scaling
        self.layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                bias = (torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]).detach()
                        if a.q_proj.bias is not None else None)
                self.layers.append((layer.input_layernorm, Int4(torch.cat([a.q_proj.weight, a.k_proj.weight,
                                                                            a.v_proj.weight])), bias,
                                    Int4(a.o_proj.weight), layer.post_attention_layernorm,
                                    Int4(torch.cat([m.gate_proj.weight, m.up_proj.weight])), Int4(m.down_proj.weight)))
            self.head = Int4(model.lm_head.weight)
        shape = (len(self.layers), self.kv_heads, capacity, self.head_dim)
        self.keys, self.values = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
        cos, sin = model.model.rotary_emb(torch.zeros((), dtype=torch.bfloat16), torch.arange(capacity)[None])
        self.cos, self.sin = cos[0], sin[0]
        self.length = 0

    @staticmethod
    def norm(module, x: torch.Tensor) -> torch.Tensor:
        v = x.float()
        return module.weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(x.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat((-b, a), -1) * sin

    @torch.inference_mode()
    def forward(self, ids, keep: int | None = None, tree=None) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.long)
        n, pos, end = ids.shape[0], self.length, self.length + ids.shape[0]
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        groups = heads // kv
        cos, sin = self.cos[pos:end, None], self.sin[pos:end, None]
        hidden = self.model.model.embed_tokens(ids)
        for i, (norm1, qkv, bias, o, norm2, gate_up, down) in enumerate(self.layers):
            x = qkv(self.norm(norm1, hidden))
            q, k, v = (x if bias is None else x + bias).split([heads * d, kv * d, kv * d], -1)
            q, k = self.rotate(q.view(n, heads, d), cos, sin), self.rotate(k.view(n, kv, d), cos, sin)
            self.keys[i, :, pos:end], self.values[i, :, pos:end] = k.transpose(0, 1), v.view(n, kv, d).transpose(0, 1)
            q = q.view(n, kv, groups, d).permute(1, 2, 0, 3).reshape(kv, groups * n, d).float()
            scores = q @ self.keys[i, :, :end].float().transpose(1, 2) * self.scaling
            if n > 1:
                hidden_slots = torch.arange(end)[None] > (pos + torch.arange(n))[:, None]
                scores = scores.view(kv, groups, n, end).masked_fill(hidden_slots, float("-inf")).view(kv, -1, end)
            out = (scores.softmax(-1) @ self.values[i, :, :end].float()).to(torch.bfloat16)
            hidden = hidden + o(out.view(kv, groups, n, d).permute(2, 0, 1, 3).reshape(n, heads * d))
            gu = gate_up(self.norm(norm2, hidden))
            hidden = hidden + down(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate:])
        self.length = end
        return self.head(self.norm(self.model.model.norm, hidden[n - (keep or n):])).float()

    def rollback(self, length: int) -> None:
        self.length = length

    def reset(self) -> None:
        self.length = 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--pair", default="qwen-coder", help="model pair (default qwen-coder)")
    parser.add_argument("--roles", default="target,draft", help="which of its models (default target,draft)")
    parser.add_argument("--tokens", default="1,2,4", help="tokens per forward (default 1,2,4)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both in turn (default 3)")
    parser.add_argument("--trials", type=int, default=6, help="forwards per side and round (default 6)")
    args = parser.parse_args(argv)
    results = Results("lean_step")
    name, _ = resolve_pair(args.pair)
    context = list(range(1000, 1100))
    for role in args.roles.split(","):
        loaded = load_model(getattr(PAIRS[name], role), torch.device("cpu"), torch.bfloat16, role=role)
        lean = Lean(loaded.model)  # packs its fused matrices from the bf16 weights, before quantize_model swaps them
        quantize_model(loaded.model, "int4", what=role)
        eager = EagerModel(loaded.model)
        graph = make_model(load_model(getattr(PAIRS[name], role), torch.device("cpu"), torch.bfloat16,
                                      role=role).model, None, "graph", role, quant="int4")
        eager.reset(), lean.reset(), graph.reset()
        a, b, c = eager.forward(context), lean.forward(context), graph.forward(context)
        check = {"argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
                 "max_abs_diff": (a - b).abs().max().item(), "graph_max_abs_diff": (a - c).abs().max().item()}
        layers = len(lean.layers)
        for n in map(int, args.tokens.split(",")):
            for model in (eager, lean, graph):  # the timed forward itself, on the cached text, compared too
                model.reset(), model.forward(context, keep=1)
            step = eager.forward([5] * n)
            step_diff = (step - lean.forward([5] * n)).abs().max().item()
            graph_step_diff = (step - graph.forward([5] * n)).abs().max().item()
            times = {"eager": [], "graph": [], "lean": []}
            for _ in range(args.rounds):
                for side, model in (("eager", eager), ("graph", graph), ("lean", lean)):
                    times[side] += forward_times(model, context, [5] * n, trials=args.trials)
            ms = {side: statistics.median(t) * 1e3 for side, t in times.items()}
            row = results.add({"role": role, "tokens": n, "eager_ms": ms["eager"], "graph_ms": ms["graph"],
                               "lean_ms": ms["lean"], "eager_over_graph": ms["eager"] / ms["graph"],
                               "eager_over_lean": ms["eager"] / ms["lean"], "products_eager": 7 * layers + 1,
                               "products_lean": 4 * layers + 1, **check, "forward_max_abs_diff": step_diff,
                               "graph_forward_max_abs_diff": graph_step_diff})
            print(table([row], COLUMNS), flush=True)
        del eager, lean, graph, loaded
    print(table(results.rows(), COLUMNS))
    path = results.finish({"pair": name, "threads": torch.get_num_threads(), "rounds": args.rounds,
                           "trials": args.trials, "context": len(context)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
