"""The `cje` command line (`flows.cli.main`), its command modules and the demo."""
