"""`python -m gigadecode.native`: build (or load) the native kernels now and say which run here."""

from .build import load, status

if __name__ == "__main__":
    load(verbose=False)
    print(f"gigadecode kernels: {status()}")
