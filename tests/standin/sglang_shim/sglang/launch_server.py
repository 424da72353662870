"""The stand-in under SGLang's module name (this package's docstring)."""

from tests.standin.server import main

if __name__ == "__main__":
    main()
