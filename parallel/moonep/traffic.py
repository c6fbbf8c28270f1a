"""Bytes one rank receives per MoE layer and micro-batch, forward and backward, per expert
dispatch and transport: the formulas `k3-plan` prints and the benchmark reports.

S tokens per rank, K experts per token, E experts on R ranks, latent width L, expert width I,
N expert-tensor-parallel ranks (each dispatches its N peers' S tokens, N*S, with I/N of every
expert's intermediate rows), a = bytes per activation element (2 for bf16; copied expert
weights travel in it too, their gradients in fp32), one expert's weights P = 3 * L * I
elements.
Collectives are counted as ring collectives (an all-gather or reduce-scatter of R blocks of n
bytes receives (R - 1) * n per rank). The symm_mem transport moves what the routing needs, so
its token terms are the most any routing makes one rank receive ("_max").
"""

from __future__ import annotations

from parallel.moonep.transport import copy_piece

INT32, INT64, FP32 = 4, 8, 4


def symm_mem_rows(tokens: int, top_k: int, ranks: int) -> int:
    """The most rows either symm_mem token buffer of a rank holds: a token travels once to each
    other rank holding one of its entries, and its result back: S*min(K, R-1)."""
    return tokens * min(top_k, ranks - 1)


def _expert_tensor_terms(s: int, k: int, lat: int, a: int, n: int) -> tuple[dict, dict, dict]:
    """The etp peers' exchange around the dispatch (parallel/expert_tensor_parallel.py): their
    tokens, expert ids (int32) and routing weights all-gathered before it, the partial outputs
    reduce-scattered after the combine; backward the transposes."""
    if n == 1:
        return {}, {}, {}
    forward = {"etp_token_all_gather": (n - 1) * s * lat * a,
               "etp_routing_all_gather": (n - 1) * s * k * (INT32 + FP32),
               "etp_output_reduce_scatter": (n - 1) * s * lat * a}
    backward = {"etp_token_grad_reduce_scatter": (n - 1) * s * lat * a,
                "etp_routing_weight_grad_reduce_scatter": (n - 1) * s * k * FP32,
                "etp_output_grad_all_gather": (n - 1) * s * lat * a}
    formula = {"etp": "(N-1)*S*(L*a + K*(4 + 4) + L*a), backward (N-1)*S*(2*L*a + K*4)"}
    return forward, backward, formula


def moe_layer_traffic(tokens: int, top_k: int, experts: int, ranks: int, latent: int,
                      intermediate: int, dispatch: str = "moonep",
                      activation_bytes: int = 2, transport: str = "collective",
                      expert_tensor: int = 1) -> dict[str, dict]:
    """{"forward": {term: bytes}, "backward": {term: bytes}, "formula": {term: text}}; the
    dispatch's terms (below) with S = N*S tokens and I = I/N (module docstring)."""
    etp = _expert_tensor_terms(tokens, top_k, latent, activation_bytes, expert_tensor)
    tokens, intermediate = tokens * expert_tensor, intermediate // expert_tensor
    s, k, e, r, lat, a = tokens, top_k, experts, ranks, latent, activation_bytes
    others = r - 1
    counts = others * e * INT32  # every rank's tokens per expert, for the plan
    # Copied weights, either transport: each rank relays 1/R of every w1 [2I, L] and w2 [L, I]
    # (transport.copy_piece) in two all-to-alls, in the GEMM's dtype; gradients in fp32.
    relayed = copy_piece(2 * intermediate * latent, r) + copy_piece(latent * intermediate, r)
    copies = 2 * others * (e // r) * relayed
    copies_formula = "2*(R-1)*(E/R)*(ceil(2*I*L/R) + ceil(L*I/R))"
    if dispatch == "moonep" and transport == "symm_mem":
        # Each entry's token id and row (2 x int32) and routing weight go to the rank computing
        # it: at most S*K entries. A token travels once to each other rank holding one of its
        # entries, and its result back: at most S*min(K, R-1) rows either way. The copies take
        # the relay's two steps with only the copied experts' pieces: at most the relay's bytes.
        rows = symm_mem_rows(s, k, r)
        forward = {
            "counts_all_gather": counts,
            "routing_exchange_max": s * k * (2 * INT32 + FP32),
            "token_exchange_max": rows * lat * a,
            "combine_exchange_max": rows * lat * FP32,
            "copy_weights_exchange_max": copies * a,
        }
        backward = {
            "routing_weight_grad_exchange_max": s * k * FP32,
            "token_grad_exchange_max": rows * lat * a,
            "combine_grad_exchange_max": rows * lat * FP32,
            "copy_grad_exchange_max": copies * FP32,
        }
        formula = {
            "counts_all_gather": "(R-1)*E*4",
            "routing_exchange_max": "S*K*(2*4 + 4)",
            "token_exchange_max": "S*min(K, R-1)*L*a",
            "combine_exchange_max": "S*min(K, R-1)*L*4",
            "copy_weights_exchange_max": copies_formula + "*a",
            "backward": f"S*K*4 + S*min(K, R-1)*L*(a + 4) + {copies_formula}*4",
        }
    elif dispatch == "moonep" and transport == "collective":
        forward = {
            "counts_all_gather": counts,
            # every entry's destination and row (int32) and routing weight
            "routing_all_gather": others * s * k * (INT32 + FP32),
            "token_all_gather": others * s * lat * a,
            "combine_reduce_scatter": others * s * lat * FP32,
            "copy_weights_all_to_all": copies * a,
        }
        backward = {
            "routing_weight_grad_reduce_scatter": others * s * k * FP32,
            "token_grad_reduce_scatter": others * s * lat * a,
            "combine_grad_all_gather": others * s * lat * FP32,
            "copy_grad_all_to_all": copies * FP32,
        }
        formula = {
            "counts_all_gather": "(R-1)*E*4",
            "routing_all_gather": "(R-1)*S*K*(4 + 4)",
            "token_all_gather": "(R-1)*S*L*a",
            "combine_reduce_scatter": "(R-1)*S*L*4",
            "copy_weights_all_to_all": copies_formula + "*a",
            "backward": f"(R-1)*S*K*4 + (R-1)*S*L*(a + 4) + {copies_formula}*4",
        }
    elif dispatch == "dynamic":  # all-to-all; uniform routing, worst case in the formula
        moved = s * k * others // r
        forward = {"split_sizes": others * INT64, "dispatch_all_to_all": moved * lat * a,
                   "combine_all_to_all": moved * lat * a}
        backward = {"dispatch_grad_all_to_all": moved * lat * a,
                    "combine_grad_all_to_all": moved * lat * a}
        formula = {"dispatch_all_to_all": "S*K*(R-1)/R*L*a balanced, up to (R-1)*S*K*L*a "
                                          "when every entry goes to one rank",
                   "combine_all_to_all": "the same, back", "backward": "the same, both ways"}
    elif dispatch == "moonep":
        raise ValueError(f"transport={transport!r} is invalid: 'collective' or 'symm_mem'")
    else:
        raise ValueError(f"dispatch={dispatch!r} is invalid: 'moonep' or 'dynamic'")
    forward, backward, formula = ({**forward, **etp[0]}, {**backward, **etp[1]},
                                  {**formula, **etp[2]})
    return {"forward": forward, "backward": backward, "formula": formula,
            "total": sum(forward.values()) + sum(backward.values())}
