"""Triton's interpreter patches ``triton.language`` once per launch, not once per helper call.

Under ``TRITON_INTERPRET=1`` every launch of a kernel patches ``triton.language`` to the
interpreter's semantics (``triton.runtime.interpreter._patch_lang``: an ``inspect.getmembers``
walk over ``tl``, ``tl.tensor`` and ``tl.math``) and restores it at the launch's end. Triton 3.x
also runs that walk at *every call of a* ``@triton.jit`` *helper* from inside a kernel
(``InterpretedFunction.__call__``), with nothing left to patch (the launch already patched the same
modules) and a scope it drops. Our kernels call helpers per tile (rotations, dots, block-word
unpacking), so on the CPU cuda-graph and engine tests the walk took ~28 % of the kernels' time
(py-spy, 2026-12-06).

:func:`install` makes a helper call skip the walk when the running launch already patched every
language module the helper sees; anything else (a first launch, a helper that sees a module the
launch did not patch, a launch started or ended in another thread since this one began, a Triton
without these internals) goes through Triton's own code unchanged.
The kernels compute exactly what they computed before; only the repeated bookkeeping goes.
"""

from __future__ import annotations

import functools
import inspect
import threading


def install() -> bool:
    """Install the shortcut into Triton's interpreter; ``False`` (nothing changed) when this
    Triton lacks the internals it wraps."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    scope_type, tl = getattr(interpreter, "_LangPatchScope", None), getattr(interpreter, "tl", None)
    if None in (patch_lang, executor, scope_type, tl) or getattr(patch_lang, "_once_per_launch", False):
        return False
    local = threading.local()  # .patched: the language modules this thread's launch patched; .generation
    generation, lock = [0], threading.Lock()  # bumped by every launch's start and end, in any thread

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    @functools.wraps(patch_lang)
    def once_per_launch(fn):
        langs, patched = languages(fn), getattr(local, "patched", None)
        # the shortcut only while no launch has started or ended in any thread since this one's
        # (the patching is global: another launch's end restores the originals)
        if patched and langs and langs <= patched and getattr(local, "generation", None) == generation[0]:
            return scope_type()  # nothing to restore: the launch's own scope restores everything
        scope = patch_lang(fn)
        if patched is not None:
            patched.update(langs)
        return scope

    once_per_launch._once_per_launch = True
    run_launch = executor.__call__

    def bump() -> int:
        with lock:
            generation[0] += 1
            return generation[0]

    @functools.wraps(run_launch)
    def launch(self, *args, **kwargs):
        outer = getattr(local, "patched", None), getattr(local, "generation", None)
        local.patched, local.generation = set(), bump()
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            bump()
            local.patched, local.generation = outer

    interpreter._patch_lang = once_per_launch
    executor.__call__ = launch
    return True
