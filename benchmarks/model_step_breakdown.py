"""Where the DP step's time goes: per-example backward vs clipping (run by hand).

Times, per process-CPU second (steady on a shared machine), the non-private gradient,
``vmap(grad)`` + plain sum, ``vmap(grad)`` + per-example norms + one weighted contraction,
and the vmapped forward alone. Usage: ``python benchmarks/model_step_breakdown.py wrn-16-4 8``.
"""
import os
import sys
import time

os.environ["JAX_PLATFORMS"]="cpu"
import jax
import jax.numpy as jnp
import optax

from dpscale.models.registry import get_model, get_spec

name=sys.argv[1]; B=int(sys.argv[2])
spec=get_spec(name); model=get_model(name)
x=jax.random.normal(jax.random.key(0),(B,*spec.input_shape)); y=jnp.arange(B)%10
params=jax.jit(model.init)(jax.random.key(0),x[:1])["params"]
def loss(p,x,y): return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params":p},x),y).mean()
def pe(p,x,y): return jax.vmap(jax.grad(lambda p,a,b: loss(p,a[None],b[None])),in_axes=(None,0,0))(p,x,y)
def f_np(p,x,y): return jax.grad(loss)(p,x,y)
def f_pe_sum(p,x,y): return jax.tree.map(lambda g: g.sum(0), pe(p,x,y))
def f_contract(p,x,y):
    g=pe(p,x,y); n=jnp.sqrt(sum(jnp.sum(jnp.square(l.reshape(B,-1)),1) for l in jax.tree.leaves(g)))
    s=jnp.minimum(1.0,1.0/jnp.maximum(n,1e-12)); return jax.tree.map(lambda l: jnp.tensordot(s,l,axes=1), g)
def f_fwd_pe(p,x,y): return jax.vmap(lambda a,b: loss(p,a[None],b[None]))(x,y).sum()
fns={k: jax.jit(v) for k,v in [("non-private grad",f_np),("vmap(grad)+sum",f_pe_sum),("vmap(grad)+norms+contraction",f_contract),("vmap forward only",f_fwd_pe)]}
for f in fns.values(): jax.block_until_ready(f(params,x,y))
best={k:1e9 for k in fns}
for r in range(3):
    for k,f in fns.items():
        t=time.process_time(); jax.block_until_ready(f(params,x,y)); jax.block_until_ready(f(params,x,y)); best[k]=min(best[k],(time.process_time()-t)/2)
for k,v in best.items(): print(f"{name} b={B} {k}: {v*1e3:.0f} ms CPU/step, {B/v:.0f} ex/cpu-s")
