from orchestrator.entry import main

main()
