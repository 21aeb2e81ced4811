"""Entry point for `python -m fa4gen`: runs the CLI (fa4gen.cli.main)."""

from fa4gen.cli.main import main

if __name__ == "__main__":
    main(prog_name="fa4gen")
