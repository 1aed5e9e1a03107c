from h2o_stream.cli import main

main()
