"""How far the judge's rounding leaves the protocol's "transported" policies from exact transport.

In `cje_engine.simulate.direct` the oracle label depends on the latent quality q, the judge score S on q
and the response length L, rounded to ``judge_levels`` steps. Within one rounded score the policies' q
differ in distribution (their quality shifts differ), so E[Y | S, L] is not exactly the same function for
every policy: the base policy's calibration, even known exactly, is off for a policy of other quality by

    bias_k = E_k[ m_base(S, L) ] - E_k[ Y ],   m_base(s, l) = E[Y | S = s, L = l, base].

Computed here by quadrature (q on a fine grid, Gauss-Hermite over the oracle noise and the log length), no
Monte Carlo, for each judge resolution given. Usage::

    .venv/bin/python benchmarks/judge_rounding_bias.py --levels 20,50,100,1000
"""
from __future__ import annotations

import argparse

import numpy as np
from scipy.special import ndtr

from cje_engine.simulate.direct import SimSpec, protocol_policies


def rounding_bias(judge_levels: int, spec: SimSpec | None = None, n_grid: int = 16001) -> dict[str, float]:
    """``bias_k`` above for every non-adversarial protocol policy at ``judge_levels``."""
    sp = spec or SimSpec(n_prompts=1)
    sd_q = float(np.hypot(sp.prompt_sd, sp.response_sd))
    q = np.linspace(-7.0, 9.0, n_grid)
    z, wz = np.polynomial.hermite_e.hermegauss(60)
    g = np.round(sp.oracle_levels * ndtr(q[:, None] + sp.oracle_noise_sd * z[None, :])) / sp.oracle_levels
    g = g @ (wz / wz.sum())                                    # E[Y | q]
    zl, wl = np.polynomial.hermite_e.hermegauss(40)
    wl = wl / wl.sum()
    pols = {p.name: p for p in protocol_policies() if not p.adversarial}
    dens_b = np.exp(-0.5 * ((q - pols["base"].quality_shift) / sd_q) ** 2)
    out = {}
    for name, p in pols.items():
        dens = np.exp(-0.5 * ((q - p.quality_shift) / sd_q) ** 2)
        bias = 0.0
        for zi, wi in zip(zl, wl):
            length = max(1.0, float(np.round(sp.base_length * p.verbosity * np.exp(sp.length_sd * zi))))
            s = np.round(judge_levels * ndtr(sp.judge_offset + q + sp.length_bias * np.log(length / sp.base_length)))
            _, cell = np.unique(s, return_inverse=True)
            m_base = np.bincount(cell, dens_b * g) / np.maximum(np.bincount(cell, dens_b), 1e-300)
            bias += wi * float(np.sum(dens * (m_base[cell] - g)) / np.sum(dens))
        out[name] = bias
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="20,50,100,1000", help="judge_levels values, comma-separated")
    args = ap.parse_args(argv)
    names = [p.name for p in protocol_policies() if not p.adversarial]
    print(f"{'judge levels':>12s} " + " ".join(f"{n:>9s}" for n in names))
    for lv in (int(v) for v in args.levels.split(",")):
        b = rounding_bias(lv)
        print(f"{lv:>12d} " + " ".join(f"{b[n]:+9.5f}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
