"""`python3 -m moeep`: where this installation finds libmoeep.so and what
`import deep_ep` resolves to. Exit 0 when the library loads; 1 otherwise."""

import sys

from . import _lib, deep_ep_alias


def main():
    ok = True
    try:
        lib = _lib.load_library()
        print("libmoeep: %s (%s)" % (lib.path, "with the data plane" if lib.has_data_plane else
                                     "control plane only: built without CUDA"))
    except OSError as e:
        print("libmoeep: %s" % e.strerror)
        ok = False
    deep_ep_alias.report()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
