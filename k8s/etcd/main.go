// Command etcd is etcd's server, built from go.etcd.io/etcd/server/v3 (see go.mod) in a
// module of its own: its dependency versions need not agree with Kubernetes'.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
