"""Command-line interface: one module per subcommand, all terminal rendering here."""
