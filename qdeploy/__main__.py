from qdeploy.cli import main

main()
