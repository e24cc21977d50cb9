from bouncer.cli import main

main()
