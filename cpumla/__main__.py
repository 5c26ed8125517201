from cpumla.cli.main import main

main()
