from pipec.cli import entry_point

entry_point()
