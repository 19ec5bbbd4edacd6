from batchlens.cli import main

main()
