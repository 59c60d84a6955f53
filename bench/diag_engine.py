"""Diagnostic: the inference engine on CUDA against a CPU full forward of the same fp32 weights, with each fast
backend switched on alone, to locate a disagreement. Prints relative errors of the decode logits."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

OPS = ("kda", "mla", "moe", "attnres")


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main():
    import openk3.fast  # noqa: F401
    from openk3.config import get_preset
    from openk3.infer.engine import Engine
    from openk3.infer.sampling import SamplingParams
    from openk3.model import K3ForCausalLM

    preset = os.environ.get("DIAG_PRESET", "small")
    torch.manual_seed(0)
    m = K3ForCausalLM(get_preset(preset).replace(attn_res_init="normal")).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            if layer.attn_type == "kda":
                layer.self_attn.dt_bias.uniform_(-6.0, -1.0)
    g = torch.Generator().manual_seed(2)
    V = m.config.vocab_size
    prompts = [torch.randint(5, V, (n,), generator=g).tolist() for n in (9, 70)]
    # CPU engine: reference everything, gives the token sequences
    eng = Engine(m, None, page_size=16, max_seqs=4, max_tokens=4096, record_logits=True, prefix_cache=False)
    reqs = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    seqs = [r.all_ids[:-1] for r in reqs]
    cpu_full = []
    with torch.no_grad():
        for r, s in zip(reqs, seqs):
            cpu_full.append(m(torch.tensor([s])).logits[0, r.num_prompt - 1 :].float())
    print(
        "cpu engine vs cpu full:",
        [rel(torch.stack(r.logits_log), f) for r, f in zip(reqs, cpu_full)],
        flush=True,
    )
    mc = m.to("cuda")

    def cuda_full(choice):
        for op in OPS:
            mc.set_backend(op, choice.get(op, "reference"))
        out = []
        with torch.no_grad():
            for r, s in zip(reqs, seqs):
                out.append(mc(torch.tensor([s], device="cuda")).logits[0, r.num_prompt - 1 :].float().cpu())
        return [rel(o, f) for o, f in zip(out, cpu_full)]

    def cuda_engine(choice, decode_backend):
        for op in OPS:
            mc.set_backend(op, choice.get(op, "reference"))
        e = Engine(
            mc,
            None,
            page_size=16,
            max_seqs=4,
            max_tokens=4096,
            record_logits=True,
            prefix_cache=False,
            decode_backend=decode_backend,
        )
        # teacher-force the CPU tokens: prompt = the CPU sequence up to the first generated token, then compare the
        # logits of each decode step with max_tokens=1 per extra prefix is too slow; instead generate greedily and
        # compare only while the tokens agree
        rs = e.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        errs = []
        for r, r0, f in zip(rs, reqs, cpu_full):
            n = 0
            while n < len(r.output_ids) and r.output_ids[n] == r0.output_ids[n]:
                n += 1
            got = torch.stack(r.logits_log)[: n + 1]
            errs.append((rel(got, f[: n + 1]), n + 1))
        return errs

    print("cuda full, all reference:", cuda_full({}), flush=True)
    for op in OPS:
        print(f"cuda full, {op} fast:", cuda_full({op: None}), flush=True)
    print("cuda full, all fast:", cuda_full({op: None for op in OPS}), flush=True)
    print("cuda engine, all reference, ref decode:", cuda_engine({}, "reference"), flush=True)
    print("cuda engine, all reference, triton decode:", cuda_engine({}, None), flush=True)
    for op in OPS:
        print(f"cuda engine, {op} fast, ref decode:", cuda_engine({op: None}, "reference"), flush=True)
    print("cuda engine, all fast, triton decode:", cuda_engine({op: None for op in OPS}, None), flush=True)


if __name__ == "__main__":
    main()
