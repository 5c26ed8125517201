"""What the tests share: tiny random models and their references (models.py), float64 kernel references
(reference.py), and the command as a subprocess (cli.py)."""
