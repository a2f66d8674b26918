from dflash_cli.cli import main

main()
