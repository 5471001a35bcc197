"""Which C++ error paths crash on this machine? Each case runs in its own process."""
import subprocess, sys, textwrap
CASES = {
 "cpu_out_of_range": "e=_C.OffloadEngine(torch.device('cpu'),2,_C.PinnedPool(-1)); e.acquire(5)",
 "cuda_out_of_range": "e=_C.OffloadEngine(torch.device('cuda',0),2,_C.PinnedPool(0)); e.acquire(5)",
 "cpu_grad": "l=torch.nn.Linear(4,4); e=_C.OffloadEngine(torch.device('cpu'),2,_C.PinnedPool(-1)); h=e.add_block(['w','b'],[l.weight,l.bias]); e.acquire(h)",
 "cuda_grad": "l=torch.nn.Linear(4,4); e=_C.OffloadEngine(torch.device('cuda',0),2,_C.PinnedPool(0)); h=e.add_block(['w','b'],[l.weight,l.bias]); e.acquire(h)",
 "cuda_grad_nograd_first": "l=torch.nn.Linear(4,4); e=_C.OffloadEngine(torch.device('cuda',0),2,_C.PinnedPool(0)); h=e.add_block(['w','b'],[l.weight,l.bias]);\nwith torch.no_grad(): e.acquire(h); e.release(h)\ne.acquire(h)",
 "pool_bad_backing": "_C.PinnedPool(0,'nope')",
 "cuda_limit": "p=_C.PinnedPool(0,'host_alloc',1<<20); p.allocate(8<<20)",
}
for name, body in CASES.items():
    code = "import torch\nfrom fastoffload_ext import _C\ntry:\n" + textwrap.indent(body, "    ") + "\n    print('no error')\nexcept Exception as e:\n    print(type(e).__name__, str(e).splitlines()[0][:150])\n"
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True)
    print(f"{name:24s} rc={r.returncode} {r.stdout.strip()[:200]} {r.stderr.strip().splitlines()[-1][:200] if r.returncode else ''}")
