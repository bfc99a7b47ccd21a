"""``python -m lit_instruct`` is the ``lit-instruct`` command."""

from lit_instruct.cli import main

if __name__ == "__main__":
    main()
