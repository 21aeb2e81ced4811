"""CLI stage: the `fa4gen` command line (click); see fa4gen.cli.main."""
