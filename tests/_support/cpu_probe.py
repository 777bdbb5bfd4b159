"""py-cpuinfo's answer asked once per server of forked workers (:mod:`tests._support.forked`
imports this module with its preloads): DeepSpeed's CPU op builders ask ``get_cpu_info()`` twice
in each process that builds an engine or its collectives (about a second each: it probes the
CPU in a subprocess) only to choose the compiler flags of their JIT-built ops. Every worker
forked from the server gets the server's answer instead: the same machine, the same answer."""

try:
    import cpuinfo
except ImportError:  # (without DeepSpeed's dependencies nothing asks)
    cpuinfo = None

if cpuinfo is not None:
    _INFO = cpuinfo.get_cpu_info()
    cpuinfo.get_cpu_info = lambda: dict(_INFO)
