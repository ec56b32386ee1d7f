// Live changelists (issue 11 item 2).  live.js follows the "dashboard" stream; an event from it only
// says "something changed": the list is then re-read from the server (the same URL: its filters,
// search and page) and merged in place — new rows appear (highlighted), changed cells are replaced
// (flashed), rows that left the page go unless selected; the checkboxes keep their state.  At most
// one read at a time and one per 1.5 s.  When the socket comes back the list is re-read (catching
// up on whatever happened meanwhile), and every 10 s while it is down.  Timers tick in times.js.
(function () {
  "use strict";
  var form = document.getElementById("changelist-form");
  var streams = document.getElementById("chorus-live-streams");
  if (!form || !streams || !JSON.parse(streams.textContent).length) return;

  function rowKey(row) {
    var box = row.querySelector("input.action-select");
    if (box) return box.value;
    var link = row.querySelector("th a, td a");
    return link ? link.getAttribute("href") : null;
  }

  // What the server said, without what the page adds to it (ticking text, hover titles, flashes).
  function signature(cell) {
    var copy = cell.cloneNode(true);
    copy.querySelectorAll("time").forEach(function (t) { t.textContent = ""; t.removeAttribute("title"); t.removeAttribute("data-hover"); });
    copy.querySelectorAll("[data-live-value]").forEach(function (n) { n.removeAttribute("data-live-value"); });
    copy.querySelectorAll(".chorus-flash").forEach(function (n) { n.classList.remove("chorus-flash"); });
    copy.querySelectorAll("[class]").forEach(function (n) {
      n.setAttribute("class", n.getAttribute("class").split(/\s+/).filter(Boolean).sort().join(" "));
    });
    return copy.innerHTML;
  }

  function flash(node, cls) {
    node.classList.add(cls);
    setTimeout(function () { node.classList.remove(cls); }, 3000);
  }

  function merge(fresh) {
    var table = document.getElementById("result_list");
    var next = fresh.getElementById("result_list");
    var nextForm = fresh.getElementById("changelist-form");
    if (!table || !next) {
      // The list was empty (or is now): nothing selected to keep, take the server's form as it is.
      if (nextForm && (next || !table)) form.innerHTML = nextForm.innerHTML;
      return;
    }
    var body = table.tBodies[0];
    var existing = {}, grew = false;
    Array.prototype.forEach.call(body.rows, function (row) { existing[rowKey(row)] = row; });
    Array.prototype.forEach.call(next.tBodies[0].rows, function (freshRow, index) {
      var key = rowKey(freshRow);
      var row = existing[key];
      if (row) {
        delete existing[key];
        Array.prototype.forEach.call(freshRow.cells, function (freshCell, i) {
          var cell = row.cells[i];
          if (!cell || freshCell.querySelector("input.action-select")) return;
          if (signature(cell) !== signature(freshCell)) {
            cell.innerHTML = freshCell.innerHTML;
            flash(cell, "chorus-cell-changed");
          }
        });
      } else {
        row = document.importNode(freshRow, true);
        flash(row, "chorus-row-new");
        grew = true;
      }
      if (body.rows[index] !== row) body.insertBefore(row, body.rows[index] || null);
    });
    Object.keys(existing).forEach(function (key) {
      var row = existing[key], box = row.querySelector("input.action-select");
      if (!box || !box.checked) { row.remove(); grew = true; }
    });
    var paginator = form.querySelector(".paginator"), nextPaginator = fresh.querySelector("#changelist-form .paginator");
    if (paginator && nextPaginator) paginator.innerHTML = nextPaginator.innerHTML;
    var count = document.querySelector("#changelist-search .small.quiet");
    var nextCount = fresh.querySelector("#changelist-search .small.quiet");
    if (count && nextCount) count.innerHTML = nextCount.innerHTML;
    // Django's actions.js counts the checkboxes it found at load ("0 of 50 selected"): let it
    // count the rows there are now (its handlers are idempotent, so a second set does no harm).
    if (grew && window.Actions) window.Actions(document.querySelectorAll("tr input.action-select"));
    if (window.chorusTimes) window.chorusTimes.update(table);
    form.dataset.liveReads = String(Number(form.dataset.liveReads || 0) + 1);
  }

  var busy = false, again = false, timer = null, lastRead = 0;
  function refresh() {
    if (document.hidden) { again = true; return; }
    if (busy) { again = true; return; }
    busy = true;
    lastRead = Date.now();
    fetch(location.href, {credentials: "same-origin"})
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.text(); })
      .then(function (html) { merge(new DOMParser().parseFromString(html, "text/html")); })
      .catch(function () { /* the next wake-up, reconnect or poll tries again */ })
      .then(function () { busy = false; if (again) { again = false; schedule(); } });
  }
  function schedule() {
    if (timer) return;
    timer = setTimeout(function () { timer = null; refresh(); }, Math.max(200, 1500 - (Date.now() - lastRead)));
  }

  document.addEventListener("chorus:event", schedule);
  document.addEventListener("visibilitychange", function () { if (!document.hidden && again) { again = false; schedule(); } });
  var indicator = document.getElementById("chorus-live-status");
  var downPoll = null;
  if (indicator) {
    new MutationObserver(function () {
      if (indicator.dataset.state === "live") {
        if (downPoll) { clearInterval(downPoll); downPoll = null; schedule(); }
      } else if (indicator.dataset.state === "offline" && !downPoll) {
        downPoll = setInterval(refresh, 10000);
      }
    }).observe(indicator, {attributes: true, attributeFilter: ["data-state"]});
  }
})();
