// Package broker talks to a running devbroker over its control socket
// (RUN_DIR/control.sock): one JSON request line per connection, one JSON reply
// line back (src/devbroker/broker/control.py). The plugin runs as root, which the
// broker gives the admin role.
package broker

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"path/filepath"
	"time"
)

// GPU is one GPU as the broker's "gpus" op describes it.
type GPU struct {
	Index    int    `json:"index"`
	Name     string `json:"name"`
	UUID     string `json:"uuid"`
	PCIBusID string `json:"pci_bus_id"`
	Memory   int64  `json:"memory"`
}

// Tenant is the INFO object of tenant.add / tenant.list.
type Tenant struct {
	Name    string            `json:"name"`
	Source  string            `json:"source"`
	Spec    map[string]any    `json:"spec"`
	Labels  map[string]string `json:"labels"`
	NodeDir string            `json:"node_dir"`
}

// Client calls one broker. Timeout bounds a whole call: tenant.rm waits for the
// tenant's processes to end (its grace), so it must be longer than that.
type Client struct {
	RunDir  string
	Timeout time.Duration
}

func (c *Client) socket() string { return filepath.Join(c.RunDir, "control.sock") }

// Call sends req and returns the reply; a reply with "ok": false is an error
// carrying the broker's message.
func (c *Client) Call(req map[string]any) (map[string]any, error) {
	timeout := c.Timeout
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	conn, err := net.DialTimeout("unix", c.socket(), timeout)
	if err != nil {
		return nil, fmt.Errorf("broker control socket: %w", err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(timeout))
	line, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Write(append(line, '\n')); err != nil {
		return nil, fmt.Errorf("broker %s: %w", req["op"], err)
	}
	r := bufio.NewReader(conn)
	answer, err := r.ReadBytes('\n')
	if err != nil {
		return nil, fmt.Errorf("broker %s: no answer: %w", req["op"], err)
	}
	var reply map[string]any
	if err := json.Unmarshal(answer, &reply); err != nil {
		return nil, fmt.Errorf("broker %s: bad answer: %w", req["op"], err)
	}
	if ok, _ := reply["ok"].(bool); !ok {
		msg, _ := reply["error"].(string)
		return reply, fmt.Errorf("broker %s: %s", req["op"], msg)
	}
	return reply, nil
}

// decode re-encodes part of a reply into a typed value.
func decode(v any, into any) error {
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return json.Unmarshal(raw, into)
}

// GPUs returns the broker's GPUs and its backend ("emulated" or "real").
func (c *Client) GPUs() ([]GPU, string, error) {
	reply, err := c.Call(map[string]any{"op": "gpus"})
	if err != nil {
		return nil, "", err
	}
	var gpus []GPU
	if err := decode(reply["gpus"], &gpus); err != nil {
		return nil, "", fmt.Errorf("broker gpus: %w", err)
	}
	backend, _ := reply["backend"].(string)
	return gpus, backend, nil
}

// TenantAdd creates a runtime tenant; an equal one that exists already is fine
// (the broker answers "existed": true), another spec under the name is an error.
func (c *Client) TenantAdd(name string, spec map[string]any, labels map[string]string) (existed bool, err error) {
	reply, err := c.Call(map[string]any{"op": "tenant.add", "tenant": name, "spec": spec, "labels": labels})
	if err != nil {
		return false, err
	}
	existed, _ = reply["existed"].(bool)
	return existed, nil
}

// TenantRm removes a tenant (its processes get SIGTERM, then SIGKILL after
// grace); an unknown tenant is not an error (existed false).
func (c *Client) TenantRm(name string, grace time.Duration) (existed bool, err error) {
	reply, err := c.Call(map[string]any{"op": "tenant.rm", "tenant": name, "grace": grace.Seconds()})
	if err != nil {
		return false, err
	}
	existed, _ = reply["existed"].(bool)
	return existed, nil
}

// TenantList returns every tenant, the policy file's and the runtime ones.
func (c *Client) TenantList() ([]Tenant, error) {
	reply, err := c.Call(map[string]any{"op": "tenant.list"})
	if err != nil {
		return nil, err
	}
	var ts []Tenant
	if err := decode(reply["tenants"], &ts); err != nil {
		return nil, fmt.Errorf("broker tenant.list: %w", err)
	}
	return ts, nil
}
