module cachefs.invalid/node/pause

go 1.26.0
