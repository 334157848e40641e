#!/usr/bin/env python3
"""An MoE layer whose experts are spread over the GPUs of one node, with
moeep.Buffer moving the tokens (the way a DeepEP user writes it).

    MOEEP_SOCKET=/tmp/moeepd.sock torchrun --nproc-per-node 4 client/python/examples/moe_layer.py

Prefill (many tokens) uses normal mode: get_dispatch_layout, dispatch,
per-expert MLPs on the received rows, combine. Decode (few tokens) uses
low-latency mode: per-expert slots feed a batched MLP directly, and combine
applies the router weights.
"""

import os

import torch
import torch.distributed as dist

import moeep


class MoELayer(torch.nn.Module):
    def __init__(self, group, hidden=2048, ffn=1024, num_experts=32, topk=4, max_decode_tokens=128):
        super().__init__()
        self.group, self.rank, self.ranks = group, dist.get_rank(group), dist.get_world_size(group)
        self.hidden, self.num_experts, self.topk = hidden, num_experts, topk
        self.local = num_experts // self.ranks
        self.max_decode_tokens = max_decode_tokens
        dev = torch.device("cuda", torch.cuda.current_device())
        self.router = torch.nn.Linear(hidden, num_experts, bias=False, device=dev, dtype=torch.bfloat16)
        # This rank's experts only: [local experts, hidden, ffn] and back.
        self.w_in = torch.nn.Parameter(torch.randn(self.local, hidden, ffn, device=dev, dtype=torch.bfloat16) * 0.02)
        self.w_out = torch.nn.Parameter(torch.randn(self.local, ffn, hidden, device=dev, dtype=torch.bfloat16) * 0.02)
        # One Buffer for both modes. The shapes are given, so the endpoint is
        # created here (collectively), as DeepEP's Buffer does.
        self.buffer = moeep.Buffer(group, low_latency_mode=True, hidden=hidden, num_experts=num_experts,
                                   max_tokens_per_rank=8192, num_max_dispatch_tokens_per_rank=max_decode_tokens,
                                   max_topk=topk)

    def route(self, x):
        logits = self.router(x).float()
        weights, idx = torch.topk(logits.softmax(dim=-1), self.topk, dim=-1)
        return idx.to(torch.int64), (weights / weights.sum(-1, keepdim=True)).float()

    def experts(self, e, rows):
        return torch.nn.functional.silu(rows @ self.w_in[e]) @ self.w_out[e]

    def prefill(self, x):
        idx, weights = self.route(x)
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(idx, self.num_experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=idx, topk_weights=weights)
        # Each received row, weighted by its router weights for the experts here.
        y = torch.zeros_like(recv_x, dtype=torch.float32)
        for e in range(self.local):
            sel = recv_idx == e                       # [rows, k]
            rows = sel.any(1).nonzero().flatten()
            if rows.numel():
                w = (recv_w * sel).sum(1)[rows].unsqueeze(1)
                y[rows] += w * self.experts(e, recv_x[rows]).float()
        out, _, _ = self.buffer.combine(y.to(torch.bfloat16), handle)
        return out

    def decode(self, x):
        idx, weights = self.route(x)
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            x, idx, self.max_decode_tokens, self.num_experts, use_fp8=False, return_recv_hook=True)
        hook()  # the receive phase; other work could run between send and this
        # Slots past recv_count[e] hold stale rows: compute on all of them (fixed
        # shapes, graph-friendly); combine reads only the slots in use.
        y = torch.bmm(torch.nn.functional.silu(torch.bmm(recv_x, self.w_in)), self.w_out)
        out, _, _ = self.buffer.low_latency_combine(y, idx, weights, handle)
        return out

    def reference(self, x):
        """The same layer computed without communication (experts gathered)."""
        idx, weights = self.route(x)
        w_in = [torch.empty_like(self.w_in) for _ in range(self.ranks)]
        w_out = [torch.empty_like(self.w_out) for _ in range(self.ranks)]
        dist.all_gather(w_in, self.w_in.data, group=self.group)
        dist.all_gather(w_out, self.w_out.data, group=self.group)
        w_in, w_out = torch.cat(w_in), torch.cat(w_out)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for k in range(self.topk):
            for e in idx[:, k].unique().tolist():
                rows = (idx[:, k] == e).nonzero().flatten()
                h = torch.nn.functional.silu(x[rows] @ w_in[e]) @ w_out[e]
                out[rows] += weights[rows, k].unsqueeze(1) * h.float()
        return out


def main():
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    torch.manual_seed(dist.get_rank())
    layer = MoELayer(dist.group.WORLD)
    with torch.no_grad():
        x = torch.randn(3000 + 100 * dist.get_rank(), layer.hidden, device="cuda", dtype=torch.bfloat16)
        err = (layer.prefill(x).float() - layer.reference(x)).abs().max().item()
        print("rank %d prefill: %d tokens, max |moeep - reference| %.4f" % (dist.get_rank(), x.shape[0], err))
        x = torch.randn(64, layer.hidden, device="cuda", dtype=torch.bfloat16)
        err = (layer.decode(x).float() - layer.reference(x)).abs().max().item()
        print("rank %d decode: %d tokens, max |moeep - reference| %.4f" % (dist.get_rank(), x.shape[0], err))
    layer.buffer.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
