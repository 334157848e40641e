"""`import deep_ep` served by moeep, for engines that hard-code DeepEP's name
(vLLM, SGLang, Megatron, torchtitan), opted into with MOEEP_DEEP_EP=1.

How it reaches every process: installing moeep puts moeep-deep-ep.pth into
the environment's site-packages (tools/moeep_build.py). site.py runs it at
the start of every interpreter of that environment, spawned and forked
workers included, and it calls install() when MOEEP_DEEP_EP is set to
anything but "" or "0" (the variable is inherited by the workers). Without
the variable it does nothing and `import deep_ep` behaves as it would
without moeep. In one process, `moeep.deep_ep_alias.install()` does the same.

What `import deep_ep` then gives: the package moeep/_deep_ep, loaded under
the name deep_ep. It says plainly what it is: `deep_ep.__moeep__` is True,
`deep_ep.__version__` is "1.2.1+moeep.<moeep version>" (the DeepEP API
level it stands in for, then moeep's), `deep_ep.__file__` lies inside moeep,
and its docstring says so. Its names are moeep's objects (deep_ep.Buffer is
moeep.Buffer).

A real DeepEP is never shadowed: when another deep_ep can be found (another
finder on sys.meta_path, any sys.path entry), `import deep_ep` and
`importlib.util.find_spec("deep_ep")` raise DeepEPConflictError naming both,
instead of silently picking one. It is a RuntimeError, not an ImportError, so
that an engine's `try: import deep_ep / except ImportError` cannot mistake it
for "DeepEP is not installed" and carry on without expert parallelism.

`python3 -m moeep` reports what `import deep_ep` resolves to in this
environment (report() below), with the libmoeep.so it loads.
"""

import importlib.machinery
import importlib.util
import os
import sys

ENV = "MOEEP_DEEP_EP"
NAME = "deep_ep"
# The DeepEP release whose API moeep.Buffer follows (deep_ep.__version__).
DEEPEP_API_VERSION = "1.2.1"
_ALIAS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_deep_ep")


class DeepEPConflictError(RuntimeError):
    """MOEEP_DEEP_EP asks for moeep as deep_ep, but a real deep_ep exists."""


def enabled():
    """Whether the environment asks for the alias (MOEEP_DEEP_EP)."""
    return os.environ.get(ENV, "0") not in ("", "0")


def find_real_deep_ep(skip=None):
    """Where another deep_ep is importable from (its origin or package
    directory), or None. Asks every finder on sys.meta_path but `skip`."""
    for finder in sys.meta_path:
        if finder is skip or isinstance(finder, _Finder) or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(NAME, None)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            if spec.origin and spec.origin not in ("namespace", "built-in"):
                return spec.origin
            locations = list(spec.submodule_search_locations or [])
            return locations[0] if locations else repr(spec)
    return None


class _Finder:
    """Meta path finder for the top-level name deep_ep. Its submodules
    (deep_ep.utils, deep_ep.buffer) are then found by the normal path finder
    through deep_ep.__path__, which is moeep/_deep_ep."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        real = find_real_deep_ep(skip=self)
        if real is not None:
            raise DeepEPConflictError(
                "%s=%s asks for moeep as deep_ep, but a real DeepEP is importable from %s; moeep will not "
                "shadow it. Unset %s to use that DeepEP, or uninstall it (pip uninstall deep_ep) to use moeep."
                % (ENV, os.environ.get(ENV, ""), real, ENV))
        return importlib.util.spec_from_file_location(NAME, os.path.join(_ALIAS_DIR, "__init__.py"),
                                                      submodule_search_locations=[_ALIAS_DIR])

    def invalidate_caches(self):
        pass


def installed():
    return any(isinstance(f, _Finder) for f in sys.meta_path)


def install():
    """Makes `import deep_ep` in this process resolve to moeep (idempotent).
    A deep_ep imported before stays what it is."""
    if not installed():
        sys.meta_path.insert(0, _Finder())


def uninstall():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def report():
    """Prints what `import deep_ep` gives here; True when it is moeep."""
    value = os.environ.get(ENV)
    print("%s; start-up hook %s in this interpreter" % ("%s unset" % ENV if value is None else "%s=%r" % (ENV, value),
                                                        "active" if installed() else "not active"))
    real = find_real_deep_ep()
    print("real DeepEP: %s" % (real or "none"))
    try:
        import deep_ep
    except DeepEPConflictError as e:
        print("import deep_ep: refused: %s" % e)
        return False
    except ImportError as e:
        print("import deep_ep: %s" % e)
        return False
    moeep_side = getattr(deep_ep, "__moeep__", False)
    print("import deep_ep: %s %s from %s" % ("moeep" if moeep_side else "DeepEP",
                                             getattr(deep_ep, "__version__", "?"), deep_ep.__file__))
    return bool(moeep_side)

